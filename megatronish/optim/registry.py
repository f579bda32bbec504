"""The optimizers by name (optim.interface.Optimizer.name): adamw, muon."""

from __future__ import annotations

from megatronish.optim.adamw import AdamWOptimizer
from megatronish.optim.interface import Optimizer
from megatronish.optim.muon import MuonOptimizer

OPTIMIZERS: dict[str, Optimizer] = {opt.name: opt for opt in (AdamWOptimizer(), MuonOptimizer())}


def optimizer_named(name: str) -> Optimizer:
    """The optimizer called name; a name not registered is a programming error (KeyError)."""
    return OPTIMIZERS[name]
