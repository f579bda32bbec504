"""Qwen3.5's blocks at every layout (the parity harness, tests/parity.py): 10 fp32 steps give the
losses and gradient norms of one process within 1e-5 relative, for the gated attention (its
gates split over tp with the heads; RoPE on part of each head at the zigzag chunks' global
positions under cp, or the positions within each document under document masks) and for
Qwen3.5-MoE (experts split over ep, the shared expert's gate replicated, ZeRO-3 gathering
it as any weight)."""

from __future__ import annotations

from pathlib import Path

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

# Heads of 16 (4 of their dims rotate) over 2 kv groups, two micro-batches of 4 a step.
GATED = [
    "model.arch=qwen3_5",
    "model.n_kv_head=2",
    "model.head_dim=16",
    "model.n_layer=2",
    "train.micro_batch_size=4",
]
EXPERTS = [*GATED, "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_ff=24"]
DOCUMENTS = ["data.document_mask=true", "data.eod_mask_loss=true"]

# name -> (tp, cp, dp, pp, overrides); each one's reference: its model.* and data.* settings at
# one rank.
VARIANTS = {
    "qwen3_5 tp2 cp2 sp documents": (2, 2, 1, 1, GATED + SP + DOCUMENTS),
    "qwen3_5 tp2 pp2 selective recompute": (
        2, 1, 1, 2, GATED + ["train.activation_checkpointing=selective"],
    ),
    "qwen3_5 experts cp2 pp2": (1, 2, 1, 2, EXPERTS),
    "qwen3_5 experts dp4 ep2 zero3": (
        1, 1, 4, 1, EXPERTS + ["parallel.ep=2", "optim.zero=3", "train.micro_batch_size=2"],
    ),
}  # fmt: skip


def _train_on_ranks(rank: int, world: int, dataset: Path) -> dict:
    results = {}
    for name, (tp, cp, dp, pp, overrides) in VARIANTS.items():
        cfg = make_config(tp, dp, pp, overrides, dataset, cp=cp)
        losses, norms, _ = train_counted(make_trainer(cfg, world, dataset), STEPS)
        results[name] = {"losses": losses, "norms": norms, "mtp_losses": []}
    return results


@pytest.fixture(scope="module")
def four_ranks(dataset):
    return run_on_ranks(_train_on_ranks, 4, dataset, timeout=400)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_qwen3_5_at_every_layout_gives_the_losses_and_grad_norms_of_one_process(
    name, four_ranks, dataset
):
    settings = [o for o in VARIANTS[name][4] if not o.startswith(("parallel.", "train.act"))]
    ref = reference(settings, dataset)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # the runs really learn
    assert_curves_match(four_ranks, name, ref)
