"""How a parallel linear layer computes and communicates, fixed when it is built (the model
derives each layer's plan from the config: megatronish.model.plan)."""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.fp8 import Recipe, TokenGroups
from megatronish.layers.formats import HIGH_PRECISION, HighPrecision
from megatronish.layers.fp8_format import Fp8

Format = HighPrecision | Fp8
"""A linear layer's numeric format (megatronish.layers.formats)."""


def numeric_format(recipe: Recipe | None) -> Format:
    """The numeric format of a layer whose plan has `recipe` (None: the autocast precision)."""
    return HIGH_PRECISION if recipe is None else Fp8(recipe)


@dataclass(frozen=True)
class LinearPlan:
    """recipe: the numeric format of the layer's GEMMs (an fp8 recipe; None: the autocast
    precision). overlap: its tp collectives decomposed under the GEMMs (parallel.tp_comm_overlap:
    megatronish.layers.overlap). tokens: the groups its tokens are split over (fp8 scales span
    them)."""

    recipe: Recipe | None = None
    overlap: bool = False
    tokens: TokenGroups = TokenGroups()


PLAIN = LinearPlan()
