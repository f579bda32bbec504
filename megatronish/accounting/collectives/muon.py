"""Muon's collectives (optim.name muon, megatronish.optim.muon): after each step's backward,
every matrix split over tp is all-gathered whole in bf16 over the tp group (one call per logical
matrix: accounting.muon's list), for Newton-Schulz on every rank that holds a shard of it;
under ZeRO only the matrices a rank owns (accounting.muon.owned_matrices: their average)."""

from __future__ import annotations

from megatronish.accounting.collectives.step import Collective, Purpose
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
