"""Multi-head (grouped-query) attention, model.attention mha (megatronish.model.attention): a
column-parallel qkv projection of n_head + 2 n_kv_head heads of head_dim from the layer input,
optionally biased (``BlockComponents.qkv_bias``), with a gate row per query row under
``BlockComponents.attention_gate`` (Qwen3.5), and with norms of queries and keys
(model.qk_norm, each rank's over its heads), and the row-parallel output projection (biased
with ``BlockComponents.linear_bias``)."""

from __future__ import annotations

from megatronish.config import Derived
from megatronish.config.derive import head_dim_of
from megatronish.config.schema import ModelConfig

QKV_PARTS = 3
"""The logical matrices of the qkv weight's rows (q, k and v; megatronish.fp8.parts), one more
with attention_gate (``qkv_parts``)."""


def qkv_parts(model: ModelConfig) -> int:
    """The logical matrices of the qkv weight's rows: q, (its gate,) k and v."""
    return QKV_PARTS + int(model.components.attention_gate)


def qk_norm_params(model: ModelConfig, derived: Derived) -> int:
    """Parameters of the query and key norms (model.qk_norm): head_dim each."""
    return 2 * derived.head_dim if model.qk_norm else 0


def qkv_heads(model: ModelConfig, derived: Derived) -> int:
    """Heads of head_dim rows in the qkv projection: the queries, their gates (attention_gate),
    the keys and the values."""
    gates = model.n_head if model.components.attention_gate else 0
    return model.n_head + gates + 2 * derived.n_kv_head


def parameters(model: ModelConfig, derived: Derived, tp: int = 1) -> int:
    """Parameters of one layer's attention on one of tp ranks (tp 1: all of them): the
    projections' weights split over tp, the qkv bias split, the output projection's bias and
    the query and key norms whole, the sinks (attention_sinks: one per head) split."""
    h, parts = model.d_model, model.components
    qkv_out = qkv_heads(model, derived) * derived.head_dim // tp
    weights = qkv_out * h + h * (model.n_head * derived.head_dim // tp)
    biases = (qkv_out if parts.qkv_bias else 0) + (h if parts.linear_bias else 0)
    return weights + biases + qk_norm_params(model, derived) + sink_params(model, tp)


def sink_params(model: ModelConfig, tp: int = 1) -> int:
    """The sink logits of one layer on one of tp ranks: one per query head (attention_sinks)."""
    return model.n_head // tp if model.components.attention_sinks else 0


def sp_replicated(model: ModelConfig, derived: Derived) -> int:
    """Of ``parameters``, those replicated on the tp ranks whose gradients are summed over tp
    under sequence parallelism: the output projection's bias and the query and key norms."""
    bias = model.d_model if model.components.linear_bias else 0
    return bias + qk_norm_params(model, derived)


def tp_summed(model: ModelConfig, derived: Derived) -> int:
    """Of ``parameters``, those whose gradients are summed over tp at any tp (each rank's covers
    its heads): the query and key norms."""
    return qk_norm_params(model, derived)


def fp8_exempt(model: ModelConfig, derived: Derived) -> int:
    """Of one tp rank's ``parameters``, those outside its fp8 layers: the query and key norms
    and the sinks."""
    return qk_norm_params(model, derived) + sink_params(model, derived.tp)


def matmul_params(model: ModelConfig, derived: Derived) -> int:
    """Weights in a matmul per token: qkv and the output projection."""
    h = model.d_model
    qkv = h * qkv_heads(model, derived) * derived.head_dim
    return qkv + model.n_head * derived.head_dim * h


def gemm_names(model: ModelConfig) -> tuple[str, ...]:
    """``gemms``' names, in order."""
    return ("qkv", "proj")


def gemms(model: ModelConfig, derived: Derived, T: int, N: int) -> list[tuple[int, int, int]]:
    """(rows, columns, inner) of the forward GEMMs of T tokens on one tp rank (N: its share
    under sequence parallelism, unused): qkv and the output projection."""
    heads, hd, h = model.n_head // derived.tp, derived.head_dim, model.d_model
    return [(T, qkv_heads(model, derived) // derived.tp * hd, h), (T, h, heads * hd)]


WHOLE_ACTIVATIONS = 3
"""What attention keeps whole on every tp rank without sequence parallelism, in 16-bit s b h
(Korthikanti et al. 2022): its input (2) and the dropout mask after it (1)."""


def activations(model: ModelConfig) -> tuple[int, float, float, float]:
    """What it keeps per layer in units of 16-bit s b h (megatronish.accounting.memory): (whole
    on every tp rank, ``WHOLE_ACTIVATIONS``; q, k, v and the output projection's input, split
    over tp: 8 when the heads span d_model; nothing replicated; no latents)."""
    heads = 8 * model.n_head * head_dim_of(model) / model.d_model
    return WHOLE_ACTIVATIONS, heads, 0.0, 0.0


def tp_inputs(model: ModelConfig, tokens: int, operand_bytes: int) -> tuple[bool, int]:
    """(whether it takes the layer input through a column-parallel projection, qkv's; bytes of
    what else enters the tp region per layer for `tokens` tokens: none)."""
    return True, 0


def cache_elements(model: ModelConfig, derived: Derived) -> tuple[int, int]:
    """Elements one tp rank's decode cache holds per token and layer: (what it holds, the keys
    and values of its heads), both the keys and values."""
    full = derived.n_kv_head // derived.tp * (derived.head_dim + derived.v_head_dim)
    return full, full
