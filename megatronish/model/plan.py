"""The config turned into each layer's plan (megatronish.layers.plan), once, before the model
is built: which linear layers take fp8 GEMMs (train.precision fp8) and which decompose their tp
collectives (parallel.tp_comm_overlap)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatronish.config import Config, Derived
from megatronish.distributed.layout import ParallelState
from megatronish.fp8 import RECIPES, TokenGroups
from megatronish.layers.plan import LinearPlan


@dataclass(frozen=True)
class ModelPlan:
    """blocks: the plan of the blocks' linear layers and routed experts (each block's attention
    projections and its dense MLP or its MoE layer's experts, the multi-token prediction blocks'
    too): fp8 under train.precision fp8. others: every other tp linear (the output layer), never
    fp8 (nor the embeddings, the routers or anything outside the blocks)."""

    blocks: LinearPlan
    others: LinearPlan


def model_plan(cfg: Config, derived: Derived, ps: ParallelState, fp8: bool = True) -> ModelPlan:
    """The plans of cfg's model on ps's rank. fp8=False: without train.precision's fp8 GEMMs
    (the autocast precision alone, as inference runs a checkpoint)."""
    others = LinearPlan(overlap=cfg.parallel.tp_comm_overlap and derived.tp > 1)
    if not fp8 or cfg.train.precision != "fp8":
        return ModelPlan(blocks=others, others=others)
    recipe = replace(RECIPES[cfg.train.fp8_recipe], backend=cfg.kernels.backend)
    tokens = TokenGroups(ps.cp_group, ps.tp_cp_group) if ps.cp > 1 else TokenGroups()
    return ModelPlan(blocks=replace(others, recipe=recipe, tokens=tokens), others=others)
