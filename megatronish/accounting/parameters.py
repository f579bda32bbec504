"""Parameter counts: of the full model (total and active per token), of one MoE MLP, and of
what one tp rank of a pipeline stage holds (the count its data-parallel gradient collectives
carry), MoE layers per stage, and the replicated parameters whose gradients are summed over tp
(under sequence parallelism; the query and key norms at any tp)."""

from __future__ import annotations

from megatronish.config import Config, Derived
from megatronish.config.mla_shapes import mla_shapes


def mla_params(cfg: Config) -> tuple[int, int, int]:
    """Multi-head latent attention's parameters of one layer (model.attention mla), as (split
    over tp: q or q_b, kv_b and proj, whole; the replicated down-projections q_a and kv_a; the
    replicated norms of their latents)."""
    shapes, h = mla_shapes(cfg.model), cfg.model.d_model
    q_in = h if shapes.q_rank is None else shapes.q_rank
    split = q_in * shapes.q_out + shapes.kv_rank * shapes.kv_b_out + shapes.proj_in * h
    down = h * (shapes.latent + (shapes.q_rank or 0))
    return split, down, shapes.normed


def parameter_count(cfg: Config, derived: Derived, active: bool = False) -> int:
    """Parameters of the full model (all tp and ep ranks together), at the real (unpadded)
    vocab; active: those one token goes through (of each MoE MLP the router, its top_k experts
    and the shared experts; the first_k_dense blocks are dense)."""
    model, h = cfg.model, cfg.model.d_model
    bias = model.gpt2_block
    norm = 2 * h if bias else h
    qkv_out = (model.n_head + 2 * derived.n_kv_head) * derived.head_dim
    attn = h * qkv_out + model.n_head * derived.head_dim * h + (qkv_out + h if bias else 0)
    attn += (qkv_out if model.qkv_bias else 0) + (2 * derived.head_dim if model.qk_norm else 0)
    if model.attention == "mla":
        attn = sum(mla_params(cfg))
    mlp = (2 if model.gpt2_block else 3) * h * derived.d_ff + (derived.d_ff + h if bias else 0)
    per_layer = attn + mlp + 2 * norm
    embed = derived.vocab_size * h + (model.max_seq_len * h if model.gpt2_block else 0)
    head = 0 if derived.tie_embeddings else derived.vocab_size * h
    moe = len(derived.moe_layers)
    experts = moe * (moe_mlp_params(cfg, derived, active) - mlp) if moe else 0  # MTP's too
    mtp = model.mtp_depth * (per_layer + mtp_extra_params(cfg))
    return model.n_layer * per_layer + experts + embed + norm + head + mtp


def mtp_extra_params(cfg: Config) -> int:
    """Parameters of one multi-token prediction module besides its block, replicated on
    the tp ranks: enorm, hnorm, its final norm and eh_proj (2h -> h)."""
    h = cfg.model.d_model
    norm = 2 * h if cfg.model.gpt2_block else h
    return 3 * norm + 2 * h * h


def approx_tp_rank_parameters(cfg: Config, derived: Derived, total: int) -> int:
    """About the parameters one tp rank holds, from the model's total: all split over tp but
    gpt2's position embedding (the replicated norms and biases are counted split, the vocab
    unpadded; ``local_parameter_count`` is exact)."""
    replicated = cfg.model.max_seq_len * cfg.model.d_model if cfg.model.gpt2_block else 0
    return (total - replicated) // derived.tp + replicated


def moe_mlp_params(cfg: Config, derived: Derived, active: bool = False) -> int:
    """Parameters of one MoE MLP: the router, every expert (active: the top_k a token goes
    through) and the shared experts (the sigmoid router's routing bias is state, not a
    trained parameter: not counted)."""
    moe, h, f = cfg.model.moe, cfg.model.d_model, derived.moe_d_ff
    experts = moe.top_k if active else moe.num_experts
    return moe.num_experts * h + experts * 3 * h * f + 3 * h * derived.shared_d_ff


def local_parameter_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Parameters one tp rank of pipeline stage pp_rank holds (the padded vocab included): the
    elements its data-parallel gradient all-reduce (or ZeRO reduce-scatter and all-gather)
    carries. The first stage holds the embeddings, the last the final norm, the output layer and
    the multi-token prediction modules (with tied embeddings or those modules and pp > 1, a copy
    of the token embedding)."""
    model, tp, h = cfg.model, derived.tp, cfg.model.d_model
    first, last = pp_rank == 0, pp_rank == derived.pp - 1
    gpt2 = model.gpt2_block
    norm = 2 * h if gpt2 else h
    vocab_local = derived.padded_vocab_size // tp
    embed = vocab_local * h + (model.max_seq_len * h if gpt2 else 0) if first else 0
    head = vocab_local * h if last and not derived.tie_embeddings else 0
    head += vocab_local * h if last and not first and derived.last_stage_embedding else 0
    mtp_moe = mtp_moe_layers(derived, pp_rank)
    blocks = blocks_params(
        cfg, derived, derived.stage_layers[pp_rank], stage_moe_layers(derived, pp_rank) - mtp_moe
    )
    return blocks + embed + (norm if last else 0) + head + mtp_params(cfg, derived, pp_rank)


def blocks_params(cfg: Config, derived: Derived, layers: int, moe: int) -> int:
    """Parameters of `layers` transformer layers on one tp rank, `moe` of them with a MoE
    MLP."""
    dense = (layers - moe) * local_layer_params(cfg, derived)
    return dense + moe * local_layer_params(cfg, derived, moe=True)


def local_layer_params(cfg: Config, derived: Derived, moe: bool = False) -> int:
    """Parameters of one transformer layer on one tp rank (moe: with a MoE MLP)."""
    model, tp, h = cfg.model, derived.tp, cfg.model.d_model
    gpt2 = model.gpt2_block
    norm = 2 * h if gpt2 else h
    qkv_out = (model.n_head + 2 * derived.n_kv_head) * derived.head_dim // tp
    attn = qkv_out * h + h * (model.n_head * derived.head_dim // tp)
    attn += qkv_out + h if gpt2 else qkv_out if model.qkv_bias else 0
    attn += 2 * derived.head_dim if model.qk_norm else 0
    if model.attention == "mla":
        split, down, norms = mla_params(cfg)
        attn = split // tp + down + norms
    f_local = derived.d_ff // tp
    mlp = (2 if gpt2 else 3) * f_local * h + (f_local + h if gpt2 else 0)
    return attn + 2 * norm + (local_moe_params(cfg, derived) if moe else mlp)


def stage_moe_layers(derived: Derived, pp_rank: int) -> int:
    """MoE layers on pipeline stage pp_rank, the multi-token prediction blocks' on the last
    among them (mtp_moe_layers)."""
    layers = {i for span in derived.stage_chunks(pp_rank) for i in span}
    return len(layers.intersection(derived.moe_layers)) + mtp_moe_layers(derived, pp_rank)


def mtp_moe_layers(derived: Derived, pp_rank: int) -> int:
    """The multi-token prediction blocks with a MoE MLP on stage pp_rank (on the last: the
    MoE block indices from n_layer on; else 0)."""
    if pp_rank != derived.pp - 1:
        return 0
    return sum(1 for i in derived.moe_layers if i >= sum(derived.chunk_layers))


def local_moe_params(cfg: Config, derived: Derived, experts_only: bool = False) -> int:
    """Parameters of one MoE MLP on one rank: the router, its num_experts / ep experts (each
    f / t wide) and the shared experts (experts_only: its experts alone)."""
    moe, h = cfg.model.moe, cfg.model.d_model
    f_local = derived.moe_d_ff // derived.tp
    experts = moe.num_experts // derived.ep * 3 * h * f_local
    if experts_only:
        return experts
    return moe.num_experts * h + experts + 3 * h * derived.shared_d_ff // derived.tp


def sequence_parallel_grad_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Elements of the replicated parameters whose gradients the trainer sums over the tp group
    under sequence parallelism on stage pp_rank: every norm, (gpt2) the row-parallel biases,
    the MoE routers (each tp rank routes its own tokens), multi-head latent attention's
    down-projections and their norms, and the multi-token prediction modules' replicated
    parameters."""
    h, gpt2 = cfg.model.d_model, cfg.model.gpt2_block
    norm = 2 * h if gpt2 else h
    row_biases = 2 * h if gpt2 else 0
    last = pp_rank == derived.pp - 1
    routers = stage_moe_layers(derived, pp_rank) * cfg.model.moe.num_experts * h
    qk_norms = 2 * derived.head_dim if cfg.model.qk_norm else 0
    mla = sum(mla_params(cfg)[1:]) if cfg.model.attention == "mla" else 0
    per_layer = 2 * norm + row_biases + qk_norms + mla
    mtp = cfg.model.mtp_depth * (per_layer + mtp_extra_params(cfg))
    return derived.stage_layers[pp_rank] * per_layer + (norm + mtp if last else 0) + routers


def tp_summed_grad_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Elements of the replicated parameters whose gradients the trainer sums over the tp group
    on stage pp_rank (outside the gradient buckets): under sequence parallelism those of
    ``sequence_parallel_grad_count``; without it the query and key norms (model.qk_norm) alone,
    each tp rank's gradient covering its heads; none at tp 1."""
    if derived.tp == 1:
        return 0
    if cfg.parallel.sequence_parallel:
        return sequence_parallel_grad_count(cfg, derived, pp_rank)
    layers = derived.stage_layers[pp_rank] + last_stage_mtp(cfg, derived, pp_rank)
    return layers * 2 * derived.head_dim if cfg.model.qk_norm else 0


def mtp_params(cfg: Config, derived: Derived, pp_rank: int) -> int:
    """Parameters of the multi-token prediction modules on one tp rank of stage pp_rank (their
    blocks dense or MoE as config.derive.moe_layers says)."""
    depth = last_stage_mtp(cfg, derived, pp_rank)
    blocks = blocks_params(cfg, derived, depth, mtp_moe_layers(derived, pp_rank))
    return blocks + depth * mtp_extra_params(cfg)


def last_stage_mtp(cfg: Config, derived: Derived, pp_rank: int) -> int:
    """The multi-token prediction blocks on stage pp_rank: model.mtp_depth on the last, else 0."""
    return cfg.model.mtp_depth if pp_rank == derived.pp - 1 else 0
