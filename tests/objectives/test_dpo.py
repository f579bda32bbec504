"""DPO's pair losses are trl's formulas (sigmoid with label smoothing as conservative DPO, IPO
on the log-ratios averaged over each response's tokens); a resumed DPO run keeps the reference
log-probabilities of the initial weights and continues the curve of an uninterrupted run, and
`eval` of its checkpoint gives the validation metrics the run logged (exit 2 without the
reference); the train.dpo settings out of range exit 2 with one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatronish.config import load_config
from megatronish.distributed.layout import ParallelState
from megatronish.objectives.dpo import DPO, METRICS
from megatronish.training.preference import REFERENCE_FILE
from tests.conftest import invoke_cli
from tests.objectives.test_dpo_curve import write_pairs
from tests.tolerances import EXACT, FP32_FEW_OPS_REL

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.seq_len=64"]
TINY += ["train.objective=dpo", "train.eval_every=0", "train.micro_batch_size=2"]
TINY += ["train.global_batch_size=4", "train.log_every=1"]


def pair_losses(loss: str, smoothing: float = 0.0) -> torch.Tensor:
    cfg = load_config(
        None,
        [f"train.dpo.loss={loss}", f"train.dpo.label_smoothing={smoothing}"]
        + ["train.objective=dpo", "train.eval_every=0", "train.dpo.beta=0.3"],
    )
    ratios = torch.tensor([[0.5, -1.0], [-2.0, 0.25], [0.0, 0.0]])
    counts = torch.tensor([[2.0, 5.0], [1.0, 3.0], [4.0, 4.0]])
    return DPO(cfg, ParallelState.single()).pair_losses(ratios, counts), ratios, counts


def test_the_pair_losses_are_trls_sigmoid_with_label_smoothing_and_ipo():
    ours, ratios, _ = pair_losses("sigmoid", 0.2)
    delta = ratios[:, 0] - ratios[:, 1]
    cdpo = -0.8 * F.logsigmoid(0.3 * delta) - 0.2 * F.logsigmoid(-0.3 * delta)
    torch.testing.assert_close(ours, cdpo, rtol=FP32_FEW_OPS_REL, atol=EXACT)
    ours, ratios, counts = pair_losses("ipo")
    averaged = ratios / counts  # trl: each log-ratio over its completion's token count
    ipo = (averaged[:, 0] - averaged[:, 1] - 1 / (2 * 0.3)) ** 2
    torch.testing.assert_close(ours, ipo, rtol=FP32_FEW_OPS_REL, atol=EXACT)


def _train(pairs: Path, out: Path, *sets: str):
    base = TINY + [f"data.path={pairs}", f"run.out_dir={out}", f"checkpoint.dir={out / 'ckpt'}"]
    args = [a for s in [*base, *sets] for a in ("--set", s)]
    return invoke_cli("train", "--config", "configs/tiny.yaml", *args)


def _losses(out: Path) -> dict[int, float]:
    """The loss of each step of metrics.jsonl, whose lines all log DPO's metrics too."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in lines if "loss" in line]  # not the validation's
    assert all(set(METRICS) <= set(line) for line in lines)
    return {line["step"]: line["loss"] for line in lines}


def _validation(out: Path) -> dict:
    """The last validation line of metrics.jsonl."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "val_loss" in line][-1]


def test_a_resumed_dpo_run_keeps_its_reference_continues_the_curve_and_eval_gives_its_val_metrics(
    tmp_path,
):
    root = tmp_path / "data"
    root.mkdir()
    pairs = root / "pairs"
    jsonl = write_pairs(root / "pairs.jsonl")
    prepared = invoke_cli(
        "prepare",
        "--preference",
        "--input",
        str(jsonl),
        "--output",
        str(pairs),
        "--val-fraction",
        "0.25",
    )
    assert prepared.returncode == 0, prepared.stderr
    whole = _train(pairs, tmp_path / "whole", "train.steps=3", "checkpoint.save=false")
    assert whole.returncode == 0, whole.stderr
    first = _train(pairs, tmp_path / "parts", "train.steps=2")
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "parts" / "ckpt" / REFERENCE_FILE).is_file()
    second = _train(pairs, tmp_path / "parts", "train.steps=3", "train.eval_every=3")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout
    resumed, want = _losses(tmp_path / "parts"), _losses(tmp_path / "whole")
    assert want[1] == pytest.approx(math.log(2), rel=FP32_FEW_OPS_REL)  # its own reference
    assert resumed[3] == pytest.approx(want[3], rel=FP32_FEW_OPS_REL)
    evaluated = invoke_cli("eval", "--checkpoint", str(tmp_path / "parts" / "ckpt"))
    assert evaluated.returncode == 0, evaluated.stderr
    logged, printed = _validation(tmp_path / "parts"), json.loads(evaluated.stdout.splitlines()[-1])
    assert logged["step"] == printed["step"] == 3 and printed["pairs"] == 4
    for name in ["val_loss", *(f"val_{metric}" for metric in METRICS)]:
        assert printed[name] == pytest.approx(logged[name], rel=FP32_FEW_OPS_REL, abs=EXACT)
    (tmp_path / "parts" / "ckpt" / REFERENCE_FILE).unlink()
    evaluated = invoke_cli("eval", "--checkpoint", str(tmp_path / "parts" / "ckpt"))
    assert evaluated.returncode == 2 and evaluated.stderr.count("\n") == 1, evaluated.stderr
    assert f"{REFERENCE_FILE}: missing" in evaluated.stderr
    lost = _train(pairs, tmp_path / "parts", "train.steps=4")
    assert lost.returncode == 2 and lost.stderr.count("\n") == 1, lost.stderr
    assert f"{REFERENCE_FILE}: missing" in lost.stderr


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["train.objective=dpo", "train.dpo.beta=0"], "train.dpo.beta: 0.0 must be > 0"),
        (["train.dpo.beta=0.2"], "train.dpo: DPO's settings need train.objective dpo"),
    ],
)
def test_dpo_settings_out_of_range_exit_2_with_one_line_naming_the_key(sets, says):
    args = [a for s in sets for a in ("--set", s)]
    result = invoke_cli("check", "--config", "configs/tiny.yaml", *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert says in result.stderr
