"""Gated DeltaNet, the linear attention of model.layer_types' linear_attention blocks
(megatronish.model.gated_deltanet): column-parallel input projections of the layer input
(in_proj_qkv of c = k (2 e) + v f channels, in_proj_z of v f, in_proj_b and in_proj_a of v),
the depthwise convolution over the c channels (K taps), A_log and dt_bias (v each), all split
over tp by head; the gated RMSNorm's weight (f, replicated, its gradient summed over tp at any
tp: each rank normalizes its own heads) and the row-parallel out_proj; no biases. k and v are
model.linear_num_key_heads and linear_num_value_heads, e and f their head dims.

Its FLOPs beside the projections are the chunked gated delta rule's (megatronish.ops.gated_delta,
CHUNK tokens C a chunk, every value head with its own q and k): per token and value head the
GEMMs K K^T and Q K^T (2 C e each), P V' (2 C f), W S, Q S and K^T V' (2 e f each), and the two
unit-triangular solves for W and U (C e and C f)."""

from __future__ import annotations

from megatronish.accounting.components.attention import WHOLE_ACTIVATIONS
from megatronish.config import Derived
from megatronish.config.schema import ModelConfig
from megatronish.ops.gated_delta import CHUNK

QKV_PARTS = 3
"""The logical matrices of in_proj_qkv's rows per key head (q, k and its value heads' v)."""

STATE_BYTES = 4
"""The recurrent state is fp32 (the rule runs in fp32 whatever the autocast)."""

INPUT = 2
"""Of ``WHOLE_ACTIVATIONS``, the layer's input (16 bits a value)."""


def conv_channels(model: ModelConfig) -> int:
    """The convolution's channels (in_proj_qkv's rows): q and k of every key head, v of every
    value head."""
    keys, values = model.linear_num_key_heads, model.linear_num_value_heads
    return keys * 2 * model.linear_key_head_dim + values * model.linear_value_head_dim


def _value_width(model: ModelConfig) -> int:
    return model.linear_num_value_heads * model.linear_value_head_dim


def parameters(model: ModelConfig, derived: Derived, tp: int = 1) -> int:
    """Parameters of one layer's linear attention on one of tp ranks (tp 1: all of them): the
    projections, convolution, A_log and dt_bias split over tp, the gated norm's weight whole."""
    h, c, vf = model.d_model, conv_channels(model), _value_width(model)
    values = model.linear_num_value_heads
    split = h * (c + vf + 2 * values) + c * model.linear_conv_kernel_dim + 2 * values + vf * h
    return split // tp + model.linear_value_head_dim


def sp_replicated(model: ModelConfig, derived: Derived) -> int:
    """Of ``parameters``, those replicated on the tp ranks whose gradients are summed over tp
    under sequence parallelism: the gated norm's weight."""
    return model.linear_value_head_dim


def tp_summed(model: ModelConfig, derived: Derived) -> int:
    """Of ``parameters``, those whose gradients are summed over tp at any tp: the gated norm's
    weight."""
    return model.linear_value_head_dim


def fp8_exempt(model: ModelConfig, derived: Derived) -> int:
    """Of one tp rank's ``parameters``, those outside its fp8 layers: the convolution, A_log
    and dt_bias (split over tp) and the gated norm's weight."""
    values, width = model.linear_num_value_heads, model.linear_conv_kernel_dim
    split = conv_channels(model) * width + 2 * values
    return split // derived.tp + model.linear_value_head_dim


def matmul_params(model: ModelConfig, derived: Derived) -> int:
    """Weights in a matmul per token: the four input projections and out_proj."""
    h, values = model.d_model, model.linear_num_value_heads
    return h * (conv_channels(model) + 2 * _value_width(model) + 2 * values)


def gemm_names(model: ModelConfig) -> tuple[str, ...]:
    """``gemms``' names, in order (those of the linear-attention blocks' projections)."""
    return ("linear_qkv", "linear_z", "linear_b", "linear_a", "linear_out")


def gemms(model: ModelConfig, derived: Derived, T: int, N: int) -> list[tuple[int, int, int]]:
    """(rows, columns, inner) of the projections' forward GEMMs of T tokens on one tp rank (N:
    its share under sequence parallelism, unused): qkv, z, b, a and out_proj."""
    tp, h = derived.tp, model.d_model
    c, vf = conv_channels(model) // tp, _value_width(model) // tp
    values = model.linear_num_value_heads // tp
    return [(T, c, h), (T, vf, h), (T, values, h), (T, values, h), (T, h, vf)]


def rule_gemm_flops_per_token(model: ModelConfig) -> int:
    """Forward FLOPs of the chunked rule's GEMMs per token, all value heads (module doc)."""
    e, f = model.linear_key_head_dim, model.linear_value_head_dim
    return model.linear_num_value_heads * (4 * CHUNK * e + 2 * CHUNK * f + 6 * e * f)


def rule_flops_per_token(model: ModelConfig) -> int:
    """Forward FLOPs of the chunked rule per token, all value heads: its GEMMs and the two
    unit-triangular solves (C^2 per right-hand column and chunk)."""
    e, f = model.linear_key_head_dim, model.linear_value_head_dim
    solves = model.linear_num_value_heads * CHUNK * (e + f)
    return rule_gemm_flops_per_token(model) + solves


def rule_bytes(model: ModelConfig, derived: Derived, T: int, width: int) -> int:
    """Bytes the rule's kernel moves forward on T tokens of one tp rank: it reads q and k (of
    the key heads), v (width bytes each), g and beta (fp32) and writes o (width) and the state
    at each chunk start (fp32, for backward)."""
    keys, values = (
        model.linear_num_key_heads // derived.tp,
        model.linear_num_value_heads // derived.tp,
    )
    e, f = model.linear_key_head_dim, model.linear_value_head_dim
    streams = T * (width * (2 * keys * e + 2 * values * f) + 2 * STATE_BYTES * values)
    return streams + STATE_BYTES * values * e * f * -(-T // CHUNK)


def stream_elements(model: ModelConfig, derived: Derived, T: int) -> int:
    """Elements the layer's memory-bound ops read and write forward on T tokens of one tp rank:
    the convolution and its SiLU (read + write c / t), the L2 norms of q and k (read + write
    2 k e / t) and the gated norm (read o and z, write: 3 v f / t)."""
    tp = derived.tp
    qk = 2 * model.linear_num_key_heads * model.linear_key_head_dim // tp
    return T * (2 * conv_channels(model) // tp + 2 * qk + 3 * _value_width(model) // tp)


def activations(model: ModelConfig) -> tuple[int, float, float, float]:
    """What it keeps per layer in units of 16-bit s b h, beside ``kept_bytes``: (the mask after
    it, whole without sequence parallelism, as attention's; nothing split or replicated; its
    input, whole at any tp: the four projections keep the input they gather under sequence
    parallelism, where attention's qkv gathers it again in backward)."""
    return WHOLE_ACTIVATIONS - INPUT, 0.0, 0.0, float(INPUT)


def kept_bytes(
    model: ModelConfig, tp: int, cp: int, batch: int, seq: int, width: int, selective: bool
) -> int:
    """Bytes one tp rank's layer keeps for backward beyond its input (``activations``) for
    `batch` sequences of `seq` tokens (a cp rank's share), `width` bytes a 16-bit value under
    autocast (4 in fp32): the projections' outputs it reads (z, b), the gated norm's (fp32 input
    and normed values, its per-head rsqrt, the normed and gate values) and out_proj's input,
    then either (selective recompute) the inputs of the recomputed convolution and rule (qkv, a,
    b) or what they save: per cp piece the convolution's padded input and its output, the
    decay's softplus input and output, and the rule's: at cp 1 each head's q and k
    L2-normalized (fp32, with their rsqrt) and the chunked rule's saved tensors
    (``rule_kept_bytes``); at cp > 1 the state pass's (context.state_pass: it reruns each piece
    in backward) q, k and v (the SiLU's output, and v regrouped by value head: a copy unless a
    rank holds one key head or one value head a key head), g (fp32), and three states (fp32:
    the zero state and each piece's initial one, on every rank but the first)."""
    e, f = model.linear_key_head_dim, model.linear_value_head_dim
    heads, c = model.linear_num_value_heads // tp, conv_channels(model) // tp
    tokens, pieces = batch * seq, 2 if cp > 1 else 1
    piece = seq // pieces
    # the norm's fp32 input: in fp32 at cp 1 the rule's output itself, padded to whole chunks
    normed = batch * -(-seq // CHUNK) * CHUNK if width == STATE_BYTES and cp == 1 else tokens
    gate = normed * f * 4 + tokens * (f * (4 + 3 * width) + 4)  # x, y, rsqrt; o, silu, z
    out = heads * (gate + tokens * f * width + tokens * width)  # out_proj's input, b
    if selective:
        return out + tokens * (c + heads) * width  # qkv and a, kept by the checkpoint
    conv = batch * c * (model.linear_conv_kernel_dim - 1 + piece) * width * pieces
    conv += tokens * c * width  # SiLU's input
    decay = 2 * tokens * heads * 4 + 2 * heads * 4 * pieces  # softplus in, out; exp(A_log), -
    if cp > 1:
        keys = model.linear_num_key_heads // tp
        v = tokens * heads * f * width if 1 < keys < heads else 0
        rule = tokens * (c * width + heads * 4) + v + 3 * batch * heads * e * f * STATE_BYTES
    else:
        norms = 2 * tokens * heads * (e + 1) * 4
        rule = norms + rule_kept_bytes(model, heads, batch, seq, width)
    return out + conv + decay + rule


def rule_kept_bytes(model: ModelConfig, heads: int, batch: int, seq: int, width: int) -> int:
    """Bytes ops.gated_delta's chunked rule keeps for backward on `heads` value heads of `batch`
    sequences of `seq` tokens padded to n chunks of C, P = batch n C; in fp32 (width 4)
    ``_rule_kept_fp32``, else under autocast (its matmuls take `width`-byte copies of their
    operands): C-wide, the decays and A (fp32), K K^T
    and Q K^T before and P after the decays (16-bit); e-wide, q, k, k beta and W (fp32) and the
    four copies of k beta, q and k for K K^T and Q K^T; f-wide v and U (fp32); V' twice a chunk
    but the last's update; per token five fp32 factors (beta, e^G, its scaled copy, the decay to
    the chunk's end and e^G in W); per chunk its decay and the state twice (16-bit); after the
    first (whose zero state needs no gradient) W and Q S's operands (16-bit), and but the last the
    state (fp32) and K^T (16-bit); the causal mask."""
    e, f, C = model.linear_key_head_dim, model.linear_value_head_dim, CHUNK
    chunks = -(-seq // C)
    P = batch * chunks * C * heads
    if width == STATE_BYTES:
        return _rule_kept_fp32(model, batch * heads, seq)
    per_token = P * (C * (2 * 4 + 3 * width) + e * (4 * 4 + 4 * width) + f * 2 * 4 + 5 * 4)
    v_new = (2 * chunks - 1) * batch * heads * C * f * width
    state = batch * heads * (2 * chunks * e * f * width + (chunks - 1) * e * f * 4)
    later = 3 * (chunks - 1) * batch * heads * C * e * width  # W, Q and K^T after the first
    return per_token + v_new + state + later + batch * heads * chunks * 4 + C * C


def _rule_kept_fp32(model: ModelConfig, rows: int, seq: int) -> int:
    """``rule_kept_bytes`` in fp32 on `rows` (sequence, head) rows of `seq` tokens, P of them
    padded, in n chunks a row (no copies: each tensor saved once): C-wide the decays, A, K K^T,
    Q K^T and P; e-wide q, k, k beta, W and, with n > 1, the decayed Q and K; f-wide v, U and
    V'; per token four factors (e^G, its scaled copy, the decay to the chunk's end, and e^G in
    W), and beta's copy when padded; per chunk its decay and its state; the causal mask."""
    e, f, C = model.linear_key_head_dim, model.linear_value_head_dim, CHUNK
    chunks = -(-seq // C)
    P = rows * chunks * C
    wide = C * 5 + e * (4 + 2 * (chunks > 1)) + f * 3 + 4 + (seq % C > 0)
    return 4 * (P * wide + rows * chunks * (1 + e * f)) + C * C


def tp_inputs(model: ModelConfig, tokens: int, operand_bytes: int) -> tuple[bool, int]:
    """(whether it takes the layer input through a column-parallel projection: yes, the four
    share one gather under sequence parallelism; bytes of what else enters: none)."""
    return True, 0


def state_bytes(model: ModelConfig, derived: Derived, width: int) -> int:
    """Bytes of one tp rank's fixed decode cache per sequence and layer: the recurrent state
    (v/t heads of e x f, fp32) and the convolution's last K - 1 inputs (c/t channels, `width`
    bytes each)."""
    tp = derived.tp
    values = model.linear_num_value_heads // tp
    state = values * model.linear_key_head_dim * model.linear_value_head_dim * STATE_BYTES
    tail = (model.linear_conv_kernel_dim - 1) * conv_channels(model) // tp * width
    return state + tail


def cache_elements(model: ModelConfig, derived: Derived) -> tuple[int, int]:
    """Elements one tp rank's decode cache grows by per token and layer: none (its cache is
    the fixed ``state_bytes``)."""
    return 0, 0
