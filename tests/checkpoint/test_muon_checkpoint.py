"""Muon's state in checkpoints: a momentum buffer per Muon matrix (AdamW's state for the rest),
resumed bit for bit, re-sharded to another tp; a resume under another optim.name is one line
naming both, unless checkpoint.reset_optimizer starts the optimizer fresh (one line)."""

from __future__ import annotations

import json

import pytest
import torch

from megatronish.checkpoint.convert import convert_checkpoint
from megatronish.checkpoint.reader import Checkpoint
from tests.conftest import CONFIGS, SMALLEST_RUN, invoke_cli

MUON = [
    "model.arch=llama",
    "model.n_head=4",
    "model.n_kv_head=2",
    "optim.name=muon",
    "train.weight_decay=0.1",
]
QKV = "blocks.0.attn.qkv.weight"


def _train(out_dir, dataset, *sets: str):
    args = ["--config", str(CONFIGS / "tiny.yaml")]
    for s in [*SMALLEST_RUN, *MUON, f"data.path={dataset}", f"run.out_dir={out_dir}", *sets]:
        args += ["--set", s]
    return invoke_cli("train", *args)


def _losses(out_dir) -> list[float]:
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset):
    """A Muon run of 4 steps, and one of 2 steps resumed to 4 (warmup past the end: a step's
    lr does not depend on train.steps)."""
    root = tmp_path_factory.mktemp("muon-checkpoints")
    common = ["train.warmup_steps=10", "train.log_every=1", "train.eval_every=0"]
    whole = _train(root / "whole", dataset, *common, "train.steps=4")
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = _train(root / "split", dataset, *common, "train.steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _train(root / "split", dataset, *common, "train.steps=4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return root, common


def test_a_muon_run_resumed_from_its_checkpoint_continues_bit_for_bit(runs):
    root, _ = runs
    assert _losses(root / "split") == _losses(root / "whole")
    ckpt = Checkpoint(root / "split" / "checkpoints" / "step_000002")
    assert ckpt.meta["optimizer"] == {"kind": "muon"}
    assert ckpt.optimizer_kinds(QKV) == ("momentum_buffer",)
    assert ckpt.optimizer_kinds("tok_emb.weight") == ("exp_avg", "exp_avg_sq", "step")


def test_muons_state_reshards_to_another_tp(runs, tmp_path):
    root, _ = runs
    source = root / "split" / "checkpoints" / "step_000002"
    tp2 = Checkpoint(convert_checkpoint(str(source), 2, str(tmp_path / "tp2")))
    tp1 = Checkpoint(source)
    spec = tp1.specs[QKV]
    blocks = [tp2.block(QKV, "momentum_buffer", spec, 2, r) for r in range(2)]
    assert torch.equal(torch.cat(blocks), tp1.block(QKV, "momentum_buffer", spec, 1, 0))
    assert tp2.optimizer_kinds(QKV) == ("momentum_buffer",)


def test_a_resume_under_another_optimizer_is_one_line_naming_both_unless_reset(
    runs, dataset, tmp_path
):
    root, common = runs
    resume = f"checkpoint.resume={root / 'whole' / 'checkpoints' / 'step_000004'}"
    other = [*common, resume, "optim.name=adamw", "train.steps=5", "checkpoint.save=false"]
    refused = _train(tmp_path / "refused", dataset, *other)
    assert refused.returncode == 2, refused.stdout[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "muon" in lines[0] and "adamw" in lines[0], refused.stderr
    assert "checkpoint.reset_optimizer" in lines[0]
    fresh = _train(tmp_path / "fresh", dataset, *other, "checkpoint.reset_optimizer=true")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    said = [x for x in fresh.stdout.splitlines() if "starts fresh" in x]
    assert len(said) == 1 and "adamw" in said[0], fresh.stdout
    assert len(_losses(tmp_path / "fresh")) == 1  # step 5 only
