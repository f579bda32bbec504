"""The collective count's typed kinds: what each collective carries and how the tp overlap
splits it are fields set where it is made, and agree with the names check prints."""

from __future__ import annotations

import pytest

from megatronish.accounting.collectives import Purpose, Split, collectives_per_step
from megatronish.config import derive, load_config
from tests.conftest import CONFIGS


def _ops(config: str, world: int, *overrides: str):
    cfg = load_config(CONFIGS / config, ["model.vocab_size=256", *overrides])
    derived = derive(cfg, world, vocab_size=cfg.model.vocab_size)
    return [op for r in range(derived.pp) for op in collectives_per_step(cfg, derived, r)]


@pytest.mark.parametrize("sp", [True, False])
def test_decomposed_collectives_run_under_a_gemm_and_say_how_they_are_split(sp):
    ops = _ops(
        "tiny-tp2.yaml",
        2,
        "parallel.tp_comm_overlap=true",
        f"parallel.sequence_parallel={str(sp).lower()}",
    )
    split = [op for op in ops if op.split is not Split.WHOLE]
    assert split and all(op.group == "tp" and op.under for op in split)
    expected = (Split.RING, "tp_ring") if sp else (Split.CHUNKS, "all_reduce")
    assert {(op.split, op.kind) for op in split} == {expected}
    assert all(not op.under for op in ops if op.split is Split.WHOLE)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_amax_reductions_are_typed_and_only_they_are_named_fp8_amax(recipe):
    ops = _ops(
        "tiny-tp2.yaml",
        2,
        "train.precision=fp8",
        f"train.fp8_recipe={recipe}",
        "model.d_model=256",
        "model.n_head=2",
        "model.d_ff=512",
    )
    amax = [op for op in ops if op.purpose is Purpose.FP8_AMAX]
    assert amax and all(op.kind == "all_reduce" for op in amax)
    assert {op.what for op in amax} == {op.what for op in ops if op.what.startswith("fp8 amax")}


def test_every_data_parallel_gradient_reduction_is_typed_as_one():
    overrides = ("parallel.dp=4", "parallel.ep=2", "optim.zero=1", "train.global_batch_size=32")
    ops = _ops("tiny-moe.yaml", 4, *overrides)
    reductions = {op.what for op in ops if op.purpose is Purpose.GRADIENT_REDUCTION}
    assert "ZeRO-1 gradient reduce-scatter" in reductions
    assert "ZeRO-1 expert gradient reduce-scatter" in reductions
    norms = {op.what for op in ops if op.purpose is Purpose.GRADIENT_NORM}
    assert reductions.isdisjoint(norms) and "gradient norm of the expert shards" in norms
