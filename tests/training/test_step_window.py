"""A logged step's tokens_per_s and mfu divide the tokens and FLOPs of the steps since the last
logged one by the time of those same steps: evaluation and checkpoint saves between two logged
steps are left out of the time and their steps are not dropped, in a fresh and a resumed run.
An MFU over 100% is never printed without why."""

from __future__ import annotations

import types

import pytest

from megatronish.training import window
from megatronish.training.trainer import Trainer
from tests.conftest import CONFIGS, SMALLEST_RUN, invoke_cli, read_metrics
from tests.tolerances import FP64_REORDER

STEP_S, EVAL_S, SAVE_S = 1.0, 5.0, 7.0  # seconds each takes on the fake clock
TINY = [
    *SMALLEST_RUN,
    "train.log_every=4",
    "train.eval_every=2",
    "train.eval_steps=1",
    "checkpoint.every=1",
]


@pytest.fixture
def fake_clock(monkeypatch):
    """The step window's clock, moved only by train steps, evaluation and saves."""
    now = [0.0]
    monkeypatch.setattr(window, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    for name, seconds in (
        ("train_step", STEP_S),
        ("evaluate", EVAL_S),
        ("save_checkpoint", SAVE_S),
    ):
        original = getattr(Trainer, name)

        def timed(self, *args, _original=original, _seconds=seconds, **kwargs):
            now[0] += _seconds
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Trainer, name, timed)
    return now


def test_a_resumed_runs_mfu_is_its_tokens_and_flops_over_the_time_of_its_own_steps(
    dataset, tmp_path, fake_clock
):
    out = tmp_path / "run"
    sets = [*TINY, f"data.path={dataset}", f"run.out_dir={out}", f"checkpoint.dir={out}/ckpt"]
    args = ["--config", str(CONFIGS / "tiny.yaml"), *(a for s in sets for a in ("--set", s))]
    first = invoke_cli("train", *args, "--set", "train.steps=6")
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = invoke_cli("train", *args, "--set", "train.steps=12")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 6" in resumed.stdout
    lines, _ = read_metrics(out)
    assert [x["step"] for x in lines] == [4, 6, 8, 12]
    tokens_per_step = 2 * 16
    for line in lines:  # each window's steps took STEP_S each; evaluation and saves are not in
        assert line["step_time_s"] == STEP_S, line
        assert line["tokens_per_s"] == tokens_per_step / STEP_S, line
    assert len({x["mfu"] for x in lines}) == 1, lines  # the same FLOPs over the same time
    assert f"MFU {100 * lines[-1]['mfu']:.1f}%" in resumed.stdout.strip().splitlines()[-1]


def test_an_mfu_over_100_percent_is_printed_with_why(dataset, tmp_path, fake_clock, monkeypatch):
    from megatronish.training import trainer
    from megatronish.training.metrics import mfu_text

    assert mfu_text(0.5, "H100 dense bf16 peak") == "50.0% (vs H100 dense bf16 peak)"
    assert "over 100%: the model FLOPs counted exceed" in mfu_text(1.5, "H100 dense bf16 peak")
    monkeypatch.setattr(trainer, "peak_flops", lambda device: (1.0, "measured fp32 matmul on cpu"))
    sets = [*TINY, f"data.path={dataset}", f"run.out_dir={tmp_path}", "checkpoint.save=false"]
    args = ["--config", str(CONFIGS / "tiny.yaml"), *(a for s in sets for a in ("--set", s))]
    result = invoke_cli("train", *args, "--set", "train.steps=4")
    assert result.returncode == 0, result.stderr[-2000:]
    final = result.stdout.strip().splitlines()[-1]
    assert "% (vs measured fp32 matmul on cpu; over 100%: the peak was measured low" in final
    bar = [line for line in result.stderr.splitlines() if "mfu=" in line]
    assert bar and all("over 100%: the peak was measured low" in line for line in bar), bar


def test_the_measured_cpu_peak_outlasts_a_burst_of_load_that_slows_its_first_trials(monkeypatch):
    import torch

    from megatronish.training import metrics

    now = [0.0]

    def perf_counter() -> float:  # each reading 10 ms apart while the host is busy, then 1 ms
        now[0] += 0.01 if now[0] < 0.5 else 0.001
        return now[0]

    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=perf_counter))
    size = 8
    measured = metrics.measured_matmul_flops(torch.device("cpu"), size=size, min_seconds=1.0)
    # the clock's sums round at 1e-16 of 0.5 s: 1e-13 of a 1 ms trial
    assert measured == pytest.approx(2 * size**3 / 0.001, rel=FP64_REORDER)
