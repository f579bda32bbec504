"""Plain torch implementations of every op: the reference the Triton kernels are tested against.

Shapes: b batch, n heads, s sequence, d head dim, h hidden.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatronish.ops.rope import PLAIN, RopeSpec, rope_table


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """x [..., h] * rsqrt(mean(x^2) + eps) * (offset + weight), computed in fp32 (the offset
    too, as transformers' Gemma 3 and Qwen3.5 norms add their 1), returned in x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    scale = offset + weight.float() if offset else weight.float()  # no copy of an fp32 weight
    return (y * scale).to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dim of x [..., h]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def document_mask(q_segments: torch.Tensor, k_segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """bool [b, 1, s_q, s_k]: query i may see key j (same document, and j <= i when causal)
    for the document indices q_segments [b, s_q] and k_segments [b, s_k]."""
    visible = q_segments[:, :, None] == k_segments[:, None, :]
    if causal:
        visible = visible & torch.ones_like(visible[0], dtype=torch.bool).tril()
    return visible.unsqueeze(1)


def window_mask(
    q_len: int, k_len: int, window: int, device: torch.device, offset: int = 0
) -> torch.Tensor:
    """bool [s_q, s_k]: query i may see key j under a sliding window, (i + offset) - j <
    window, where offset is the first query's position less the first key's (0 when queries
    and keys are the same positions): the window keys ending at the query itself, as
    transformers' sliding_window_overlay."""
    queries = torch.arange(q_len, device=device)[:, None] + offset
    return queries - torch.arange(k_len, device=device)[None, :] < window


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    segments: torch.Tensor | None = None,
    window: int | None = None,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [b, n_head, s, d], k [b, n_kv_head, s, d], v [b, n_kv_head, s, d_v] -> [b, n_head, s,
    d_v]; scores q.k times scale (None: 1/sqrt(d)).
    With segments [b, s] (each position's document, megatronish.context.documents) a query
    sees the keys of its own document only; with a window W, the query at i sees the keys at
    j with i - j < W only (itself and the W - 1 before it when causal).
    softcap c: the scores become c * tanh(score / c) before the masks (Gemma 2's logit
    soft-capping). sinks [n_head]: one learned logit per head that joins every query's softmax
    denominator and gives no value (GPT-OSS's attention sinks)."""
    n_head, n_kv_head = q.shape[1], k.shape[1]
    if n_head != n_kv_head:
        group = n_head // n_kv_head
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = None
    if segments is not None or window is not None:
        mask = attention_mask(q.shape[2], q.device, causal, segments, window)
    if sinks is None and softcap is None:
        is_causal = causal and mask is None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale
        )
    if mask is None:
        mask = attention_mask(q.shape[2], q.device, causal, None, None)
    return explicit_attention(q, k, v, mask, scale, sinks, softcap)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention with the scores written out: q [b, n, s_q, d], k [b, n, s_k, d] and v [b, n,
    s_k, d_v] (as many heads each), visible bool broadcasting to [b, n, s_q, s_k]; the scores
    soft-capped by softcap (if any), and sinks [n] (if any) joining each row's softmax as one
    more logit that gives no value; dropout on the probabilities (the sink's left out), from the
    default stream. Computed in fp32 (fp64 for fp64 inputs), returned in q's dtype."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout > 0:
        probs = torch.nn.functional.dropout(probs, dropout)
    return (probs @ v.to(dtype)).to(q.dtype)


def attention_mask(
    seq_len: int,
    device: torch.device,
    causal: bool,
    segments: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """bool [b or 1, 1, s, s]: which keys each query of one sequence sees under the causal
    mask, the document masks of segments [b, s] (or None) and a sliding window (or None)."""
    if segments is not None:
        visible = document_mask(segments, segments, causal)
    else:
        visible = torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device)
        if causal:
            visible = visible.tril()
    if window is not None:
        visible = visible & window_mask(seq_len, seq_len, window, device)
    return visible


def rope(
    x: torch.Tensor,
    spec: RopeSpec = PLAIN,
    start_pos: int = 0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding of x [b, n, s, d] as spec says (megatronish.ops.rope) at positions
    start_pos.. (or at the given int64 positions [s], or [b, s]: each sequence's own),
    rotate-half pairing (dim i with dim i + d/2)."""
    seq_len, head_dim = x.shape[-2], x.shape[-1]
    cos, sin = rope_table(spec, seq_len, head_dim, x.device, start_pos, positions)
    if cos.dim() == 3:  # [b, s, d/2]: one table per sequence, the same for every head
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x32 = x.float()
    x1, x2 = x32[..., : head_dim // 2], x32[..., head_dim // 2 :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up, tanh approximation (Gemma)."""
    return F.gelu(gate, approximate="tanh") * up


SWIGLU_ALPHA = 1.702  # GPT-OSS's sigmoid gain: gate * sigmoid(1.702 gate) ~ gelu(gate)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """GPT-OSS: g * sigmoid(1.702 g) * (u + 1), g = gate clamped to <= limit, u = up clamped to
    [-limit, limit] (the clamps pass no gradient where they bind)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias), tanh approximation (GPT-2)."""
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate="tanh")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [A, k] rows sorted by group (offsets [G]: each group's cumulative end row) -> [A, n],
    each group's rows times its w[g] ([G, k, n]): a loop over the groups."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, ends))]
    if not parts:
        return x.new_zeros((0, w.shape[2]))
    return torch.cat(parts)
