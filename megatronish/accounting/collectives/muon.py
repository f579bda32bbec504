"""Muon's collectives (optim.name muon, megatronish.optim.muon): after each step's backward,
every matrix split over tp is all-gathered whole in bf16 over the tp group (one call per logical
matrix: accounting.muon's list), for Newton-Schulz on every rank that holds a shard of it;
under ZeRO only the matrices a rank owns (accounting.muon.owned_matrices: their average)."""

from __future__ import annotations

from megatronish.accounting.collectives.step import FP32_BYTES, Collective, Purpose, Step
from megatronish.accounting.muon import BF16_BYTES, owned_matrices
from megatronish.config import Config, Derived


def muon_collectives(cfg: Config, derived: Derived, pp_rank: int) -> list[Collective]:
    """The tp all-gathers of stage pp_rank's Muon matrices, one kind per matrix name and shape."""
    ops: dict[tuple, float] = {}
    for m in owned_matrices(cfg, derived, pp_rank):
        if m.split:
            key = (m.name, m.rows * m.cols * BF16_BYTES)
            ops[key] = ops.get(key, 0) + m.count
    return [
        Collective(
            f"Muon {name}", "all_gather", "tp", derived.tp, payload, count, Purpose.OPTIMIZER
        )
        for (name, payload), count in ops.items()
    ]


def qk_clip_collectives(step: Step) -> list[Collective]:
    """QK-clip's (optim.muon.qk_clip_tau, megatronish.optim.qk_clip; none when null): under cp,
    per micro-batch, full-attention layer and forward (recompute reruns it) this rank's keys
    all-gathered over cp for the logits of its queries, c [cp, b, k/t, s, d] (k the kv heads,
    n under MLA); once per step every layer's heads' largest logits, fp32 [L n/t], all-reduced
    (MAX) over dp x cp."""
    muon, derived = step.cfg.optim.muon, step.derived
    if step.cfg.optim.name != "muon" or muon is None or muon.qk_clip_tau is None:
        return []
    layers = step.layers - step.linear_layers
    keys = step.cp * step.b * derived.n_kv_head // step.tp * step.s * derived.head_dim
    forwards = 2 if step.cfg.train.activation_checkpointing != "none" else 1
    heads = layers * step.cfg.model.n_head // step.tp
    what = "QK-clip keys of every cp rank"
    gather = Collective(
        what, "all_gather", "cp", step.cp, keys * step.operand_bytes,
        forwards * layers * step.accum, Purpose.ACTIVATION,
    )  # fmt: skip
    what = "QK-clip largest logit of each head"
    reduce = Collective(
        what, "all_reduce", "dp", step.dp_cp, heads * FP32_BYTES, 1, Purpose.OPTIMIZER
    )
    return [gather, reduce]
