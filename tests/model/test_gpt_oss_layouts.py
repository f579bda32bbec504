"""GPT-OSS's blocks at tp 2 x dp 2 x ep 2 with ZeRO-3 and at tp 2 x cp 2, both with sequence
parallelism (the parity harness, tests/parity.py): 10 fp32 steps give the losses and gradient norms
of one process within 1e-5 relative, in one 4-rank run, and each collective sends the bytes the
accounting counts. The sinks split over tp with their heads, and at cp 2 enter the ring's softmax;
the experts over ep, their gate and up biases over tp with their rows and their down bias along
d_model; the router's logit bias replicated, its gradient summed over tp under sequence parallelism;
ZeRO-3 shards the parameters (the untied output layer's kept from its forward to its backward,
though the final norm's weight is outside its bucket). The swiglu_limit of 0.1 binds on many of the
tiny model's activations, so the clamps' zero gradients are exercised too; a dense block (its gate,
up and down biases) then an MoE one, sliding (window 4) then full, under YaRN."""

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

GPT_OSS = [
    "model.arch=gpt_oss",
    "model.n_kv_head=2",
    "model.head_dim=8",
    "model.n_layer=2",
    "model.sliding_window=4",
    "model.layer_types=[sliding_attention, full_attention]",
    "model.rope_scaling={type: yarn, factor: 4.0, original_max_position_embeddings: 8}",
    "model.swiglu_limit=0.1",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.first_k_dense=1",
    "model.moe.d_ff=24",
    "train.micro_batch_size=4",
]
# name -> (tp, dp, cp, overrides); each one's reference: GPT_OSS at one rank.
VARIANTS = {
    "gpt_oss tp2 dp2 ep2 sp zero3": (2, 2, 1, ["parallel.ep=2", "optim.zero=3"]),
    "gpt_oss tp2 cp2 sp": (2, 1, 2, []),
}


def _train_on_ranks(rank: int, world: int, dataset) -> dict:
    from megatronish.accounting.collectives import formula_payload_by_kind

    results = {}
    for name, (tp, dp, cp, layout) in VARIANTS.items():
        cfg = make_config(tp, dp, 1, GPT_OSS + SP + layout, dataset, cp=cp)
        trainer = make_trainer(cfg, world, dataset)
        losses, norms, counter = train_counted(trainer, STEPS)
        formula = formula_payload_by_kind(cfg, trainer.setup.derived, trainer.ps.pp_rank)
        results[name] = {"losses": losses, "norms": norms, "mtp_losses": []}
        results[name]["bytes"] = {"payload": dict(counter.payload_bytes), "formula": formula}
    return results


@pytest.fixture(scope="module")
def four_ranks(dataset):
    return run_on_ranks(_train_on_ranks, 4, dataset, timeout=400)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gpt_oss_at_tp_dp_ep_zero3_and_tp_cp_gives_one_process_curve_and_the_counted_bytes(
    name, four_ranks, dataset
):
    """The first step's bytes per kind of collective are the accounting's, per rank (the
    all-to-all's, which depend on the routing, summed over the ranks)."""
    ref = reference(GPT_OSS, dataset)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # the run really learns
    assert_curves_match(four_ranks, name, ref)
    counted = [rank[name]["bytes"] for rank in four_ranks]
    for rank in counted:
        sent = {kind: n for kind, n in rank["payload"].items() if kind != "all_to_all"}
        assert sent == {kind: n for kind, n in rank["formula"].items() if kind != "all_to_all"}
    routed = [
        sum(rank[key].get("all_to_all", 0) for rank in counted) for key in ("payload", "formula")
    ]
    assert routed[0] == routed[1] and (routed[0] > 0) == ("ep2" in name)
