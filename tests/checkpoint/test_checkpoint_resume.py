"""End to end: a run stopped and resumed from its checkpoint gives the loss curve of the run that
was never stopped: bitwise at the same layout (CPU, fp32), to fp32 rounding at another one."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from click.testing import CliRunner

from megatronish.cli import cli
from tests.conftest import CONFIGS, invoke_cli, read_metrics
from tests.ranks import run_cli_on_ranks
from tests.tolerances import CURVE_REL, FP32_FEW_OPS_REL

pytestmark = pytest.mark.slow  # multi-rank training, saved and resumed

# warmup_steps > steps: the learning rate of a step does not depend on train.steps, so a run of
# 3 steps is the first half of a run of 6.
BASE = [
    "model.n_layer=2",
    "model.d_model=64",
    "model.max_seq_len=64",
    "train.seq_len=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.warmup_steps=10",
    "train.log_every=1",
    "train.eval_every=3",
    "train.eval_steps=2",
]
# Fields that depend on timing or the machine, not on the training.
TIMING = ("tokens_per_s", "mfu", "step_time_s", "phases", "peak_memory_gb", "peak_memory_rank",
          "straggler")  # fmt: skip


def cli_args(out_dir, dataset, overrides) -> list[str]:
    sets = [*BASE, f"data.path={dataset}", f"run.out_dir={out_dir}", *overrides]
    return ["--config", str(CONFIGS / "tiny.yaml"), *[a for o in sets for a in ("--set", o)]]


def train(out_dir, dataset, *overrides: str):
    """`megatronish train` in this process."""
    result = invoke_cli("train", *cli_args(out_dir, dataset, overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def train_on_two_ranks(out_dir, dataset, *overrides: str) -> None:
    """`megatronish train` on two ranks as torchrun starts them (tests/ranks.py)."""
    for result in run_cli_on_ranks(["train", *cli_args(out_dir, dataset, overrides)], 2):
        assert result.returncode == 0, result.stderr[-3000:]


def curve(run_dir) -> list[dict]:
    """Every metrics line without the timing fields, in file order."""
    train_lines, val_lines = read_metrics(run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == len(train_lines) + len(val_lines)
    return [{k: v for k, v in x.items() if k not in TIMING} for x in lines]


@pytest.fixture(scope="module")
def tp1_runs(tmp_path_factory, small_dataset):
    root = tmp_path_factory.mktemp("tp1")
    whole = root / "whole"
    train(whole, small_dataset, "train.steps=6", "checkpoint.every=3", "checkpoint.keep=0")
    split = root / "split"
    train(split, small_dataset, "train.steps=3")
    resumed = train(split, small_dataset, "train.steps=6")
    return whole, split, resumed


def test_resume_at_tp1_continues_bitwise_and_metrics_hold_the_whole_curve(tp1_runs):
    whole, split, resumed = tp1_runs
    assert [x["step"] for x in curve(split)] == [1, 2, 3, 3, 4, 5, 6, 6]
    assert curve(split) == curve(whole)
    assert f"resumed from {split / 'checkpoints' / 'step_000003'} at step 3" in resumed.stdout
    assert " 3/6 " in resumed.stderr, "the progress bar starts at the resumed step"


def test_a_run_killed_after_a_checkpoint_resumes_from_latest_and_rewrites_later_metrics(
    tp1_runs, small_dataset, tmp_path
):
    whole, _, _ = tp1_runs
    killed = tmp_path / "killed"
    shutil.copytree(whole, killed)
    # As if killed during step 5: step 6 never saved, metrics up to 5 and half a line written.
    shutil.rmtree(killed / "checkpoints" / "step_000006")
    (killed / "checkpoints" / "latest").write_text("step_000003\n")
    lines = (whole / "metrics.jsonl").read_text().splitlines()[:6]
    (killed / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')
    train(killed, small_dataset, "train.steps=6", "checkpoint.every=3")
    assert curve(killed) == curve(whole)


def test_eval_of_a_checkpoint_equals_the_val_loss_the_run_logged(tp1_runs):
    whole, _, _ = tp1_runs
    result = CliRunner().invoke(cli, ["eval", "--checkpoint", str(whole / "checkpoints")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    logged = [x for x in curve(whole) if "val_loss" in x][-1]
    assert summary["step"] == logged["step"] == 6
    assert summary["val_loss"] == pytest.approx(logged["val_loss"], rel=FP32_FEW_OPS_REL)
    assert summary["perplexity"] == pytest.approx(
        math.exp(summary["val_loss"]), rel=FP32_FEW_OPS_REL
    )


def test_resume_restores_the_rng_so_dropout_continues_bitwise(tmp_path, small_dataset):
    sets = ["train.steps=6", "model.dropout=0.1", "train.eval_every=0"]
    train(tmp_path / "whole", small_dataset, *sets, "checkpoint.every=3", "checkpoint.keep=0")
    step3 = tmp_path / "whole" / "checkpoints" / "step_000003"
    train(tmp_path / "resumed", small_dataset, *sets, f"checkpoint.resume={step3}")
    assert curve(tmp_path / "resumed") == curve(tmp_path / "whole")[3:]


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory, small_dataset, tp1_runs):
    """On two ranks: a tp=2 run of 6 steps, and its step-3 checkpoint continued at tp=2 and at
    tp=1 x dp=2 with ZeRO-1 (model and optimizer re-sharded); the tp=1 run's step-3 checkpoint
    continued at tp=2 ("higher"). (At tp=1 the split run stops at step 3.)"""
    root = tmp_path_factory.mktemp("tp2")
    tp1_step3 = tp1_runs[0] / "checkpoints" / "step_000003"
    whole = ("train.steps=6", "checkpoint.every=3", "checkpoint.keep=0", "parallel.tp=2")
    train_on_two_ranks(root / "whole", small_dataset, *whole)
    higher = ("train.steps=6", "parallel.tp=2", f"checkpoint.resume={tp1_step3}")
    train_on_two_ranks(root / "higher", small_dataset, *higher)
    resume = f"checkpoint.resume={root / 'whole' / 'checkpoints' / 'step_000003'}"
    train_on_two_ranks(root / "resumed", small_dataset, "train.steps=6", "parallel.tp=2", resume)
    relaid = ("train.steps=6", "parallel.dp=2", "optim.zero=1", resume)
    train_on_two_ranks(root / "relaid", small_dataset, *relaid)
    return root


def test_resume_at_tp2_continues_bitwise(tp2_runs):
    resumed = curve(tp2_runs / "resumed")
    assert [x["step"] for x in resumed] == [4, 5, 6, 6]
    assert resumed == curve(tp2_runs / "whole")[4:]


def test_resume_at_another_tp_dp_and_zero_continues_the_same_loss_curve(tp2_runs):
    relaid, whole = curve(tp2_runs / "relaid"), curve(tp2_runs / "whole")
    assert [x["step"] for x in relaid] == [4, 5, 6, 6]
    for got, want in zip(relaid, whole[4:]):
        key = "loss" if "loss" in got else "val_loss"
        assert got["step"] == want["step"]
        assert got[key] == pytest.approx(want[key], rel=CURVE_REL)
    saved = sorted(p.name for p in (tp2_runs / "relaid" / "checkpoints" / "step_000006").iterdir())
    assert "optim_tp00_dp000.safetensors" in saved and "optim_tp00_dp001.safetensors" in saved


def test_resume_at_a_higher_tp_continues_the_same_loss_curve(tp1_runs, tp2_runs):
    for got, want in zip(curve(tp2_runs / "higher"), curve(tp1_runs[0])[4:], strict=True):
        key = "loss" if "loss" in got else "val_loss"
        assert got["step"] == want["step"]
        assert got[key] == pytest.approx(want[key], rel=CURVE_REL)
