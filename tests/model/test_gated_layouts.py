"""Qwen3.5's blocks at every layout (the parity harness, tests/parity.py): the first
LAYOUT_STEPS fp32 steps give the losses and gradient norms of one process within 1e-5
relative, for the gated attention (its gates split over tp with the heads; RoPE on part of each
head at the zigzag chunks' global positions under cp, or the positions within each document
under document masks) and for Qwen3.5-MoE (experts split over ep, the shared expert's gate
replicated, ZeRO-3 gathering it as any weight), and for the hybrid of both (3 Gated DeltaNet
blocks to 1 gated full attention: the linear heads, their projections' rows, the convolution's
channels and the decay and beta parameters split over tp; the state and the convolution
restarting at each document) at tp 2 with sequence parallelism, pp 2, dp 2 at ZeRO-3 and, with
experts, ep 2, each with document masks in one model and without in the other. The hybrid's
runs, and the others' under document masks, read documents of 3 to 13 tokens, so every sample
holds several: a layout that dropped the masks would miss every step's bound (the hybrid's
unmasked reference is the one that shows it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parity import (
    LAYOUT_STEPS,
    SP,
    assert_curves_match,
    make_config,
    make_trainer,
    prepare_short_documents,
    reference,
    train_counted,
)
from tests.ranks import run_on_ranks
from tests.tolerances import LAYOUT_CURVE_REL

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
# 3 linear-attention blocks to 1 full, the linear heads split over tp 2 (2 key heads of 8 dims,
# 4 value heads of 12).
HYBRID = [
    "model.n_layer=4",
    "model.layer_types=[linear_attention, linear_attention, linear_attention, full_attention]",
    "model.linear_num_key_heads=2",
    "model.linear_num_value_heads=4",
    "model.linear_key_head_dim=8",
    "model.linear_value_head_dim=12",
    "model.linear_conv_kernel_dim=4",
]
ZERO3 = ["optim.zero=3"]
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
    "hybrid tp2 pp2 sp documents": (2, 1, 1, 2, GATED + HYBRID + SP + DOCUMENTS),
    "hybrid tp2 dp2 zero3 sp": (2, 1, 2, 1, GATED + HYBRID + SP + ZERO3),
    "hybrid experts tp2 pp2 sp": (2, 1, 1, 2, EXPERTS + HYBRID + SP),
    "hybrid experts tp2 dp2 ep2 zero3": (
        2, 1, 2, 1, EXPERTS + HYBRID + SP + ["parallel.ep=2"] + ZERO3,
    ),
    "hybrid experts dp4 ep2 zero3 documents": (
        1, 1, 4, 1,
        EXPERTS + HYBRID + DOCUMENTS + ["parallel.ep=2", "train.micro_batch_size=2"] + ZERO3,
    ),
}  # fmt: skip


def data_of(overrides: list[str], datasets: dict[str, Path]) -> Path:
    """A variant's dataset: short documents (several in a sample) under document masks and for
    the hybrid (whose unmasked reference is then the masks' test's)."""
    short = DOCUMENTS[0] in overrides or HYBRID[1] in overrides
    return datasets["short documents" if short else "code"]


def _train_on_ranks(rank: int, world: int, datasets: dict[str, Path]) -> dict:
    results = {}
    for name, (tp, cp, dp, pp, overrides) in VARIANTS.items():
        dataset = data_of(overrides, datasets)
        cfg = make_config(tp, dp, pp, overrides, dataset, cp=cp)
        losses, norms, _ = train_counted(make_trainer(cfg, world, dataset), LAYOUT_STEPS)
        results[name] = {"losses": losses, "norms": norms, "mtp_losses": []}
    return results


@pytest.fixture(scope="module")
def datasets(dataset, tmp_path_factory) -> dict[str, Path]:
    short = prepare_short_documents(tmp_path_factory.mktemp("short-documents"))
    return {"code": dataset, "short documents": short}


@pytest.fixture(scope="module")
def four_ranks(datasets):
    return run_on_ranks(_train_on_ranks, 4, datasets, timeout=400)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_qwen3_5_at_every_layout_gives_the_losses_and_grad_norms_of_one_process(
    name, four_ranks, datasets
):
    settings = [o for o in VARIANTS[name][4] if not o.startswith(("parallel.", "train.act"))]
    ref = reference(settings, data_of(settings, datasets))
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # the runs really learn
    assert_curves_match(four_ranks, name, ref, LAYOUT_STEPS)


def test_a_layout_without_the_hybrids_document_masks_would_miss_every_steps_bound(datasets):
    hybrid = GATED + HYBRID
    short = datasets["short documents"]
    masked, plain = reference(hybrid + DOCUMENTS, short), reference(hybrid, short)
    for a, b in zip(masked["losses"], plain["losses"]):
        assert abs(a - b) > LAYOUT_CURVE_REL * abs(b)
