"""Multi-head latent attention, model.attention mla (megatronish.model.mla), its shapes from
megatronish.config.mla_shapes: replicated down-projections (q_a without q_lora_rank none, kv_a)
with norms of their latents on the layer input, and the column-parallel up-projections (q or
q_b, kv_b) and row-parallel output projection split over tp; no biases, no query and key
norms (model.qk_norm is refused with it)."""

from __future__ import annotations

from megatronish.accounting.components.attention import WHOLE_ACTIVATIONS
from megatronish.config import Derived
from megatronish.config.mla_shapes import mla_shapes
from megatronish.config.schema import ModelConfig

QKV_PARTS = 1
"""The logical matrices of its fp8 "qkv" layer's rows (megatronish.fp8.parts)."""


def split_params(model: ModelConfig) -> tuple[int, int, int]:
    """One layer's parameters as (split over tp: q or q_b, kv_b and proj, whole; the replicated
    down-projections q_a and kv_a; the replicated norms of their latents)."""
    shapes, h = mla_shapes(model), model.d_model
    q_in = h if shapes.q_rank is None else shapes.q_rank
    split = q_in * shapes.q_out + shapes.kv_rank * shapes.kv_b_out + shapes.proj_in * h
    down = h * (shapes.latent + (shapes.q_rank or 0))
    return split, down, shapes.normed


def parameters(model: ModelConfig, derived: Derived, tp: int = 1) -> int:
    """Parameters of one layer's attention on one of tp ranks (tp 1: all of them)."""
    split, down, norms = split_params(model)
    return split // tp + down + norms


def sp_replicated(model: ModelConfig, derived: Derived) -> int:
    """Of ``parameters``, those replicated on the tp ranks whose gradients are summed over tp
    under sequence parallelism: the down-projections and their latents' norms."""
    return sum(split_params(model)[1:])


def tp_summed(model: ModelConfig, derived: Derived) -> int:
    """Of ``parameters``, those whose gradients are summed over tp at any tp: none."""
    return 0


def fp8_exempt(model: ModelConfig, derived: Derived) -> int:
    """Of one tp rank's ``parameters``, those outside its fp8 layers: the replicated
    down-projections and their latents' norms (``sp_replicated``)."""
    return sp_replicated(model, derived)


def matmul_params(model: ModelConfig, derived: Derived) -> int:
    """Weights in a matmul per token: every projection, the down-projections among them."""
    return sum(split_params(model)[:2])


def gemm_names(model: ModelConfig) -> tuple[str, ...]:
    """``gemms``' names, in order (the column-parallel one the queries take, "qkv")."""
    rest = ("kv_down", "kv_up", "proj")
    return ("qkv", *rest) if model.mla.q_lora_rank is None else ("q_down", "qkv", *rest)


def gemms(model: ModelConfig, derived: Derived, T: int, N: int) -> list[tuple[int, int, int]]:
    """(rows, columns, inner) of the forward GEMMs of T tokens on one tp rank: the
    down-projections on its N tokens (its share under sequence parallelism), the
    up-projections and the output projection."""
    mla, h = mla_shapes(model, model.n_head // derived.tp), model.d_model
    out = [(N, mla.latent, h), (T, mla.kv_b_out, mla.kv_rank), (T, h, mla.proj_in)]
    if mla.q_rank is None:
        return [(T, mla.q_out, h), *out]
    return [(N, mla.q_rank, h), (T, mla.q_out, mla.q_rank), *out]


def activations(model: ModelConfig) -> tuple[int, float, float, float]:
    """What it keeps per layer in units of 16-bit s b h: (its input and the dropout mask after
    it, whole on every tp rank without sequence parallelism, as mha's; the heads' q, k, v and
    attention output, split over tp; the inputs of the latents' norms, replicated, on the
    sequence shard under sequence parallelism; the latents that enter the tp region, the
    up-projections' inputs, whole at any tp)."""
    shapes = mla_shapes(model)
    heads = 2 * (2 * shapes.q_out + 2 * shapes.proj_in)
    norms = 2 * shapes.normed
    latents = 2 * shapes.entering_tp
    h = model.d_model
    return WHOLE_ACTIVATIONS, heads / h, norms / h, latents / h


def tp_inputs(model: ModelConfig, tokens: int, operand_bytes: int) -> tuple[bool, int]:
    """(whether it takes the layer input through a column-parallel projection: the query
    projection without q_lora_rank; bytes of the latents entering the tp region together per
    layer for `tokens` tokens)."""
    mla = mla_shapes(model)
    return mla.q_rank is None, tokens * mla.entering_tp * operand_bytes


def cache_elements(model: ModelConfig, derived: Derived) -> tuple[int, int]:
    """Elements one tp rank's decode cache holds per token and layer: (the normed latent and
    the shared rotary key, whole on every tp rank; the keys and values of its heads it
    rebuilds from them)."""
    full = derived.n_kv_head // derived.tp * (derived.head_dim + derived.v_head_dim)
    return mla_shapes(model).latent, full
