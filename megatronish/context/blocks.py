"""One block of ring attention: queries against one block of keys, forward with its
log-sum-exp, and the flash backward from a given (final) output and log-sum-exp.

Shapes: b batch, n query heads, k kv heads (k divides n; query head i reads kv head
i // (n / k)), L block length (queries and keys alike), d query-key head dim, e value head dim
(e may differ from d: multi-head latent attention). q [b, n, L, d]; o, do [b, n, L, e];
k [b, k, L, d], v [b, k, L, e]; lse [b, n, L] fp32 (fp64 for fp64 inputs), natural log. Scale
1/sqrt(d) unless given; softcap c (or None): the scores s become c tanh(s / c) before the masks.

Backward, with p = exp(scores - lse) and delta = rowsum(do * o) taken from the final
output: dv = p^T do, ds = p (do v^T - delta), times 1 - tanh^2(s / c) under a soft-cap,
dq = ds k * scale, dk = ds^T q * scale. It is linear in the blocks, so a ring sums each
block's dq, dk, dv. A block knows no sinks: the ring joins them to its final lse, once.

Document masks: segments None, or (the queries' [b, L], the keys' [b, L]) document indices
(megatronish.context.documents); a query sees the keys of its own document only. Sliding
window: window None, or W with offset, the block's first query's position less its first
key's; query i sees key j only when (i + offset) - j < W. A row with no key it may see in the
block gets o 0 and lse -inf, which the ring's merge then ignores.

The torch path materializes one block's L x L scores; the Triton path runs the flash kernels
of megatronish_kernels (no L x L matrix; it skips the key blocks of other documents and those
outside the window).
"""

from __future__ import annotations

import math

import torch

from megatronish.ops import reference


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32: what partial outputs, lse and gradients are kept in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype):
    """q as [b, k, n/k, L, d] and k as [b, k, 1, L, d], in dtype."""
    b, n, length, d = q.shape
    kv = k.shape[1]
    return q.to(dtype).view(b, kv, n // kv, length, d), k.to(dtype).unsqueeze(2)


def _scores(q, k, causal: bool, dtype, segments, window, offset: int, scale, softcap):
    """(masked scores [b, k, n/k, L, L], d capped / d raw score or None without a soft-cap)."""
    qg, kg = _grouped(q, k, dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = qg @ kg.transpose(-1, -2) * scale
    slope = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores, slope = softcap * capped, 1.0 - capped * capped
    length = q.shape[2]
    if segments is not None:
        visible = reference.document_mask(*segments, causal).unsqueeze(1)  # [b, 1, 1, L, L]
    elif causal:
        visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    else:
        visible = None
    if window is not None:
        inside = reference.window_mask(length, length, window, q.device, offset)
        visible = inside if visible is None else visible & inside
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores, slope


def torch_forward(
    q, k, v, causal: bool, segments=None, window=None, offset: int = 0, *, scale=None, softcap=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [b, n, L, e], lse [b, n, L]), both in the accumulation dtype."""
    dtype = accumulation_dtype(q.dtype)
    b, n, length = q.shape[:3]
    scores, _ = _scores(q, k, causal, dtype, segments, window, offset, scale, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # a row that sees no key: o 0
    out = torch.exp(scores - finite.unsqueeze(-1)) @ v.to(dtype).unsqueeze(2)
    return out.view(b, n, length, v.shape[-1]), lse.view(b, n, length)


def torch_backward(
    q, k, v, out, lse, dout, causal: bool, segments=None, window=None, offset=0, *, scale=None,
    softcap=None,
):  # fmt: skip
    """(dq [b, n, L, d], dk [b, k, L, d], dv [b, k, L, e]) in the accumulation dtype, from the
    final output `out` and log-sum-exp `lse` of these queries."""
    dtype = accumulation_dtype(q.dtype)
    b, n, length, d = q.shape
    kv, e = k.shape[1], v.shape[-1]
    qg, kg = _grouped(q, k, dtype)
    scores, slope = _scores(q, k, causal, dtype, segments, window, offset, scale, softcap)
    probs = torch.exp(scores - lse.to(dtype).view(b, kv, n // kv, length, 1))
    dog = dout.to(dtype).view(b, kv, n // kv, length, e)
    og = out.to(dtype).view(b, kv, n // kv, length, e)
    dv = (probs.transpose(-1, -2) @ dog).sum(dim=2)
    dprobs = dog @ v.to(dtype).unsqueeze(2).transpose(-1, -2)
    delta = (dog * og).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta)
    if slope is not None:
        dscores = dscores * slope
    dscores = dscores * (1.0 / math.sqrt(d) if scale is None else scale)
    dq = (dscores @ kg).view(b, n, length, d)
    dk = (dscores.transpose(-1, -2) @ qg).sum(dim=2)
    return dq, dk, dv


def triton_forward(
    q, k, v, causal: bool, segments=None, window=None, offset: int = 0, *, scale=None, softcap=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton flash forward: (o fp32, or fp64 for fp64 inputs; lse fp32, natural log), o
    [b, n, L, dv] at v's head dim dv where it differs from q's and k's (the head dims
    megatronish_kernels.attention takes)."""
    from megatronish.ops import _kernels

    options = dict(scale=scale, softcap=softcap)
    return _kernels().attention_block_forward(q, k, v, causal, segments, window, offset, **options)


def triton_backward(
    q, k, v, out, lse, dout, causal: bool, segments=None, window=None, offset=0, *, scale=None,
    softcap=None,
):  # fmt: skip
    """The Triton flash backward from a given output (at v's head dim) and natural-log lse: dq,
    dk, dv in the inputs' dtype and shapes."""
    from megatronish.ops import _kernels

    return _kernels().attention_block_backward(
        q, k, v, out.to(q.dtype), lse, dout, causal, segments, window, offset, scale=scale,
        softcap=softcap,
    )  # fmt: skip


def block_ops(backend: str):
    """(forward, backward) of the resolved backend "torch" or "triton"."""
    if backend == "triton":
        return triton_forward, triton_backward
    return torch_forward, torch_backward
