"""The optimizers by name (optim.interface.Optimizer.name)."""

from __future__ import annotations

from megatronish.optim.adamw import AdamWOptimizer
from megatronish.optim.interface import Optimizer

OPTIMIZERS: dict[str, Optimizer] = {opt.name: opt for opt in (AdamWOptimizer(),)}


def optimizer_named(name: str) -> Optimizer:
    """The optimizer called name; a name not registered is a programming error (KeyError)."""
    return OPTIMIZERS[name]
