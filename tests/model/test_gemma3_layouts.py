"""Gemma 3's blocks at tp 2 x pp 2 with sequence parallelism and at tp 2 x cp 2 (the parity harness,
tests/parity.py): 10 fp32 steps give the losses and gradient norms of one process within 1e-5
relative, in one 4-rank run, and each collective sends the bytes the accounting counts. Three
sliding blocks of window 5 (their own RoPE base) then a global one (linearly scaled RoPE): at pp 2
the second stage holds a sliding block and the global one, so each block's kind and RoPE follow its
global index; the sandwich norms are replicated over tp and see this rank's tokens under sequence
parallelism. The tp x pp run soft-caps the attention scores and the output logits (on each rank's
vocab shard); the cp run the attention scores alone, in each of the ring's blocks (the attention
kernels' soft-cap). With the final soft-cap at cp 2 every step's gradient norm is one process's
within 5e-8 at a learning rate of 1e-9, but AdamW's first steps amplify that rounding past 1e-5 by
step 6; the same holds without caps at the harness's learning rate of 3e-3 once the ring applies the
scale in its blocks (1.2e-5 by step 7), so the cp run takes 2e-3, where it still learns."""

from __future__ import annotations

import pytest

from tests.parity import (
    SP,
    STEPS,
    assert_curves_match,
    make_config,
    make_trainer,
    reference,
    train_counted,
)
from tests.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # a 4-rank training run

GEMMA3 = [
    "model.arch=gemma3",
    "model.n_kv_head=2",
    "model.head_dim=8",
    "model.query_pre_attn_scalar=12",
    "model.sliding_window=5",
    "model.layer_types=[sliding_attention, sliding_attention, sliding_attention, full_attention]",
    "model.rope_scaling={type: linear, factor: 4}",
    "train.micro_batch_size=4",
]
SOFTCAPS = ["model.attn_logit_softcapping=2", "model.final_logit_softcapping=5"]

# name -> (tp, cp, pp, overrides); each one's reference: its model.* settings at one rank.
VARIANTS = {
    "gemma3 tp2 pp2 sp softcaps": (2, 1, 2, GEMMA3 + SP + SOFTCAPS),
    "gemma3 tp2 cp2 sp attn softcap": (2, 2, 1, GEMMA3 + SP + SOFTCAPS[:1] + ["train.lr=2e-3"]),
}


def _train_on_ranks(rank: int, world: int, dataset) -> dict:
    from megatronish.accounting.collectives import formula_payload_by_kind

    results = {}
    for name, (tp, cp, pp, overrides) in VARIANTS.items():
        cfg = make_config(tp, 1, pp, overrides, dataset, cp=cp)
        trainer = make_trainer(cfg, world, dataset)
        losses, norms, counter = train_counted(trainer, STEPS)
        formula = formula_payload_by_kind(cfg, trainer.setup.derived, trainer.ps.pp_rank)
        results[name] = {"losses": losses, "norms": norms, "mtp_losses": []}
        results[name]["bytes"] = (dict(counter.payload_bytes), formula)
    return results


@pytest.fixture(scope="module")
def four_ranks(dataset):
    return run_on_ranks(_train_on_ranks, 4, dataset, timeout=400)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gemma3_at_tp_pp_and_cp_gives_one_process_curves_and_sends_the_counted_bytes(
    name, four_ranks, dataset
):
    settings = [o for o in VARIANTS[name][3] if not o.startswith("parallel.")]
    ref = reference(settings, dataset)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # the runs really learn
    assert_curves_match(four_ranks, name, ref)
    for rank in four_ranks:
        sent, counted = rank[name]["bytes"]  # the first step's, per kind of collective
        assert sent == counted
