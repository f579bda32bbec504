"""Parameter counts: of the full model (total and active per token), of one layer and of what
one tp rank of a pipeline stage holds (the count its data-parallel gradient collectives carry),
MoE layers per stage, and the replicated parameters whose gradients are summed over tp (under
sequence parallelism; the query and key norms at any tp): sums over the components' counts
(accounting.components), each block's attention its own kind (model.layer_types)."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from megatronish.accounting.components import ATTENTION, attention_at, embedding, mlp, norm
from megatronish.accounting.components import moe as moe_cost
from megatronish.accounting.memo import per_config, per_model
from megatronish.config import Config, Derived


def layer_params(
    cfg: Config, derived: Derived, tp: int = 1, moe: bool = False, index: int = 0
) -> int:
    """Parameters of transformer block `index` on one of tp ranks (tp 1: all of them, the MLP
    dense): its attention, its norms and its MLP (moe: the MoE MLP on one rank)."""
    return _kind_params(cfg, derived, tp, moe, cfg.model.block_attention(index))


@per_model
def _kind_params(cfg: Config, derived: Derived, tp: int, moe: bool, kind: str) -> int:
    """``layer_params`` of a block whose attention is of `kind` (the only way its index counts)."""
    model = cfg.model
    attn = ATTENTION[kind].parameters(model, derived, tp)
    ffn = (
        moe_cost.local_parameters(cfg, derived)
        if moe
        else mlp.parameters(model, derived.d_ff // tp)
    )
    return attn + norm.block_parameters(model) + ffn


def parameter_count(cfg: Config, derived: Derived, active: bool = False) -> int:
    """Parameters of the full model (all tp and ep ranks together), at the real (unpadded)
    vocab; active: those one token goes through (of each MoE MLP the router, its top_k experts
    and the shared experts; the first_k_dense blocks are dense)."""
    model = cfg.model
    blocks = sum(layer_params(cfg, derived, index=i) for i in range(model.n_layer))
    mtp_blocks = range(model.n_layer, model.n_layer + model.mtp_depth)
    mtp = sum(layer_params(cfg, derived, index=i) + mtp_extra_params(cfg) for i in mtp_blocks)
    embed = embedding.parameters(model, derived.vocab_size)
    head = 0 if derived.tie_embeddings else derived.vocab_size * model.d_model
    moe = len(derived.moe_layers)
    dense_mlp = mlp.parameters(model, derived.d_ff)
    experts = moe * (moe_cost.parameters(cfg, derived, active) - dense_mlp)  # MTP's too
    return blocks + experts + embed + norm.weights(model) + head + mtp


def mtp_extra_params(cfg: Config) -> int:
    """Parameters of one multi-token prediction module besides its block, replicated on
    the tp ranks: enorm, hnorm, its final norm and eh_proj (2h -> h)."""
    h = cfg.model.d_model
    return 3 * norm.weights(cfg.model) + 2 * h * h


def approx_tp_rank_parameters(cfg: Config, derived: Derived, total: int) -> int:
    """About the parameters one tp rank holds, from the model's total: all split over tp but
    the learned position table (the replicated norms and biases are counted split, the vocab
    unpadded; ``local_parameter_count`` is exact)."""
    replicated = embedding.position_params(cfg.model)
    return (total - replicated) // derived.tp + replicated


@per_model
def local_parameter_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Parameters one tp rank of pipeline stage pp_rank holds (the padded vocab included): the
    elements its data-parallel gradient all-reduce (or ZeRO reduce-scatter and all-gather)
    carries. The first stage holds the embeddings, the last the final norm, the output layer and
    the multi-token prediction modules (with tied embeddings or those modules and pp > 1, a copy
    of the token embedding)."""
    model, tp, h = cfg.model, derived.tp, cfg.model.d_model
    first, last = pp_rank == 0, pp_rank == derived.pp - 1
    vocab_local = derived.padded_vocab_size // tp
    embed = embedding.parameters(model, vocab_local) if first else 0
    head = vocab_local * h if last and not derived.tie_embeddings else 0
    head += vocab_local * h if last and not first and derived.last_stage_embedding else 0
    mtp_moe = mtp_moe_layers(derived, pp_rank)
    blocks = blocks_params(
        cfg, derived, stage_blocks(derived, pp_rank), stage_moe_layers(derived, pp_rank) - mtp_moe
    )
    final_norm = norm.weights(model) if last else 0
    return blocks + embed + final_norm + head + mtp_params(cfg, derived, pp_rank)


def stage_blocks(derived: Derived, pp_rank: int) -> list[int]:
    """The global indices of the transformer blocks on pipeline stage pp_rank (its chunks')."""
    return [i for span in derived.stage_chunks(pp_rank) for i in span]


def blocks_params(cfg: Config, derived: Derived, blocks: Iterable[int], moe: int) -> int:
    """Parameters of the transformer blocks of these indices on one tp rank, `moe` of them
    with a MoE MLP."""
    dense = sum(local_layer_params(cfg, derived, index=i) for i in blocks)
    moe_extra = local_layer_params(cfg, derived, moe=True) - local_layer_params(cfg, derived)
    return dense + moe * moe_extra


def local_layer_params(cfg: Config, derived: Derived, moe: bool = False, index: int = 0) -> int:
    """Parameters of transformer block `index` on one tp rank (moe: with a MoE MLP)."""
    return layer_params(cfg, derived, derived.tp, moe, index)


@functools.lru_cache(maxsize=4096)  # a Derived never changes; the planner asks again and again
def stage_moe_layers(derived: Derived, pp_rank: int) -> int:
    """MoE layers on pipeline stage pp_rank, the multi-token prediction blocks' on the last
    among them (mtp_moe_layers)."""
    layers = set(stage_blocks(derived, pp_rank))
    return len(layers.intersection(derived.moe_layers)) + mtp_moe_layers(derived, pp_rank)


def mtp_moe_layers(derived: Derived, pp_rank: int) -> int:
    """The multi-token prediction blocks with a MoE MLP on stage pp_rank (on the last: the
    MoE block indices from n_layer on; else 0)."""
    if pp_rank != derived.pp - 1:
        return 0
    return sum(1 for i in derived.moe_layers if i >= sum(derived.chunk_layers))


def sequence_parallel_grad_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Elements of the replicated parameters whose gradients the trainer sums over the tp group
    under sequence parallelism on stage pp_rank: every norm, the row-parallel biases (biases all:
    attention's output projection, the dense MLPs' and shared experts' down projections),
    the MoE routers (each tp rank routes its own tokens), multi-head latent attention's
    down-projections and their norms, and the multi-token prediction modules' replicated
    parameters."""
    model = cfg.model
    last = pp_rank == derived.pp - 1
    moe_layers = stage_moe_layers(derived, pp_rank)
    routers = moe_layers * moe_cost.router_params(cfg)
    blocks = stage_blocks(derived, pp_rank) + mtp_blocks(cfg, derived, pp_rank)
    # The dense MLPs' down biases: the MoE blocks have one only in their shared experts.
    mlps = len(blocks) - (0 if derived.shared_d_ff else moe_layers)
    norms = len(blocks) * norm.block_parameters(model) + mlps * mlp.sp_replicated(model)
    attn = sum(attention_at(model, i).sp_replicated(model, derived) for i in blocks)
    mtp = cfg.model.mtp_depth * mtp_extra_params(cfg) if last else 0
    final_norm = norm.weights(model) if last else 0
    return norms + attn + mtp + final_norm + routers


@per_config
def tp_summed_grad_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Elements of the replicated parameters whose gradients the trainer sums over the tp group
    on stage pp_rank (outside the gradient buckets): under sequence parallelism those of
    ``sequence_parallel_grad_count``; without it the query and key norms (model.qk_norm) alone,
    each tp rank's gradient covering its heads; none at tp 1."""
    if derived.tp == 1:
        return 0
    if cfg.parallel.sequence_parallel:
        return sequence_parallel_grad_count(cfg, derived, pp_rank)
    blocks = stage_blocks(derived, pp_rank) + mtp_blocks(cfg, derived, pp_rank)
    return sum(attention_at(cfg.model, i).tp_summed(cfg.model, derived) for i in blocks)


def mtp_params(cfg: Config, derived: Derived, pp_rank: int) -> int:
    """Parameters of the multi-token prediction modules on one tp rank of stage pp_rank (their
    blocks dense or MoE as config.derive.moe_layers says)."""
    blocks = mtp_blocks(cfg, derived, pp_rank)
    params = blocks_params(cfg, derived, blocks, mtp_moe_layers(derived, pp_rank))
    return params + len(blocks) * mtp_extra_params(cfg)


def mtp_blocks(cfg: Config, derived: Derived, pp_rank: int) -> list[int]:
    """The multi-token prediction blocks' indices on stage pp_rank (n_layer on, on the last)."""
    first = cfg.model.n_layer
    return list(range(first, first + last_stage_mtp(cfg, derived, pp_rank)))


def last_stage_mtp(cfg: Config, derived: Derived, pp_rank: int) -> int:
    """The multi-token prediction blocks on stage pp_rank: model.mtp_depth on the last, else 0."""
    return cfg.model.mtp_depth if pp_rank == derived.pp - 1 else 0
