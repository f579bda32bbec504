"""DPO's one-time reference pass as accounting.dpo counts it and check and plan print it: whole
global batches of each split's pairs (train, validation), their forward tokens, a third of a
training step's model FLOPs and predicted time per batch, and a table of two fp32 a pair; the
pass a run makes forwards exactly the tokens counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronish.accounting.dpo import reference_pass
from megatronish.config import load_config
from megatronish.distributed.layout import ParallelState
from megatronish.training import preference
from tests.conftest import invoke_cli
from tests.objectives.test_dpo_curve import PAIRS, write_pairs
from tests.parity import make_config, make_trainer
from tests.tolerances import FP32_FEW_OPS_REL

SEQ_LEN, BATCH = 64, 4
DPO = ["train.objective=dpo", f"train.seq_len={SEQ_LEN}", f"model.max_seq_len={SEQ_LEN}"]
DPO += ["train.micro_batch_size=2", f"train.global_batch_size={BATCH}"]
VAL_PAIRS = PAIRS // 4  # --val-fraction 0.25 of the pairs' documents, whole pairs
TRAIN_PAIRS = PAIRS - VAL_PAIRS
BATCHES = -(-TRAIN_PAIRS // BATCH) - (-VAL_PAIRS // BATCH)  # each split's, rounded up
LAYOUT = "tp=1 pp=1 v=1 cp=1 dp=1"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo-pass")
    source, out = write_pairs(root / "pairs.jsonl"), root / "pairs"
    args = ["--input", str(source), "--output", str(out), "--val-fraction", "0.25"]
    result = invoke_cli("prepare", "--preference", *args)
    assert result.returncode == 0, result.stderr
    return out


def test_the_pass_is_each_splits_pairs_in_whole_global_batches_at_a_third_of_a_step():
    cfg = load_config(None, DPO)
    ref = reference_pass(cfg, 3.0e9, (13, 3), 17)  # 4 + 1 batches of 4 pairs
    assert (ref.batches, ref.tokens) == (5, 5 * BATCH * SEQ_LEN)
    assert ref.flops == pytest.approx(5 * 1.0e9, rel=FP32_FEW_OPS_REL)
    assert ref.seconds(0.3) == pytest.approx(5 * 0.1, rel=FP32_FEW_OPS_REL)
    assert (ref.table_bytes, ref.working_bytes) == (17 * 2 * 4, 17 * 4 * 8)


def _line(result) -> str:
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("DPO reference"))


def test_check_and_plan_print_the_reference_pass_of_a_dpo_run(pairs):
    args = [a for s in [*DPO, f"data.path={pairs}"] for a in ("--set", s)]
    counted = (
        f"{TRAIN_PAIRS} train + {VAL_PAIRS} validation pairs in {BATCHES} global batches, "
        f"{BATCHES * BATCH * SEQ_LEN:,} forward tokens"
    )
    table = f"its table {PAIRS * 8} bytes on every rank ({PAIRS * 32} while computed)"
    checked = _line(invoke_cli("check", "--config", "configs/tiny.yaml", *args))
    assert counted in checked and table in checked and " s;" not in checked  # no device
    plan = ["plan", "--config", "configs/tiny.yaml", *args, "--gpu", "H100", "--gpus", "1"]
    planned = _line(invoke_cli(*plan, "--layout", LAYOUT))
    as_json = invoke_cli(*plan, "--layout", LAYOUT, "--json")
    step_time_s = json.loads(as_json.stdout.splitlines()[-1])["step_time_s"]
    assert counted in planned and f", ~{BATCHES * step_time_s / 3:.3g} s;" in planned
    assert planned.replace(f", ~{BATCHES * step_time_s / 3:.3g} s", "") == checked


def test_a_dpo_runs_reference_pass_forwards_the_tokens_counted(pairs, monkeypatch):
    forwarded = []
    batch_tensors = preference.batch_tensors

    def counting(step, *args):
        forwarded.append(step.tokens[..., :-1].numel())  # rows x seq_len inputs
        return batch_tensors(step, *args)

    monkeypatch.setattr(preference, "batch_tensors", counting)
    cfg = make_config(1, 1, 1, DPO, pairs)
    make_trainer(cfg, 1, pairs, ParallelState.single())  # the pass runs as the run starts
    assert sum(forwarded) == reference_pass(cfg, 0.0, (TRAIN_PAIRS, VAL_PAIRS), PAIRS).tokens
