"""The config turned into each layer's plan, once, before the model is built: which linear
layers take fp8 GEMMs (train.precision fp8) and which decompose their tp collectives
(parallel.tp_comm_overlap: megatronish.layers.plan), and each block's BlockPlan, what its
modules read beyond their model.* section (kernels, parallel and train settings)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatronish.config import Config, Derived
from megatronish.config.components import AttentionKind, BlockComponents
from megatronish.context import Ring
from megatronish.distributed.layout import ParallelState, RNGTracker
from megatronish.fp8 import RECIPES, TokenGroups
from megatronish.layers.plan import PLAIN, LinearPlan


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


@dataclass(frozen=True)
class BlockPlan:
    """How block `index` (its global index; multi-token prediction module k's block is
    n_layer + k - 1) is built on this rank, beside model.*: its components, its linear layers'
    plan, the kernel backend, sequence parallelism (on at tp > 1: the norms' and the residual
    dropout's tokens are this rank's s / t; `linear_sequence_parallel`: parallel.sequence_parallel
    as set, also at tp 1, what the dense attention's and MLP's linear layers take), selective
    recompute (of the attention core), the attention it runs (the components' full attention,
    or gated_deltanet where model.layer_types makes it linear attention), whether its MLP is a
    mixture of experts, the sizes derived from the config, this rank's groups and the RNG
    tracker of its dropout."""

    index: int
    components: BlockComponents
    linear: LinearPlan
    backend: str
    sequence_parallel: bool
    linear_sequence_parallel: bool
    selective_recompute: bool
    attention: AttentionKind
    moe: bool
    derived: Derived
    ps: ParallelState
    tracker: RNGTracker
    logit_max: bool = False
    """Whether its attention records each head's largest logit (optim.muon.qk_clip_tau set)."""

    def ring(self) -> Ring | None:
        """This rank's ring attention ring under context parallelism (cp > 1), else None."""
        return Ring.of(self.ps) if self.derived.cp > 1 else None


def block_plan(
    cfg: Config,
    derived: Derived,
    ps: ParallelState,
    tracker: RNGTracker,
    index: int,
    linear: LinearPlan = PLAIN,
) -> BlockPlan:
    """The plan of cfg's block `index` on ps's rank; linear: ModelPlan.blocks (model_plan)."""
    return BlockPlan(
        index=index,
        components=cfg.model.components,
        linear=linear,
        backend=cfg.kernels.backend,
        sequence_parallel=cfg.parallel.sequence_parallel and derived.tp > 1,
        linear_sequence_parallel=cfg.parallel.sequence_parallel,
        selective_recompute=cfg.train.activation_checkpointing == "selective",
        attention=cfg.model.block_attention(index),
        moe=index in derived.moe_layers,
        derived=derived,
        ps=ps,
        tracker=tracker,
        logit_max=cfg.optim.muon is not None and cfg.optim.muon.qk_clip_tau is not None,
    )
