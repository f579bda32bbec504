"""Fused attention's autograd function and public entry (megatronish_kernels.functions): the
forward kernel's pass (attention.py) and the backward's launches (attention_bwd.py), with the
softmax scale, the logits' soft-cap and the attention sinks (shapes and formulas there).

Sinks [n_head], a logit per query head that joins every row's softmax denominator and gives no
value: the forward kernel joins them to each row's lse (lse' = logaddexp(lse, sink), base 2
here), so the backward's p = exp2(s - lse') already holds them and dq, dk, dv need nothing
more. The sinks' own gradient, p_sink (0 - delta) summed over the rows (delta = rowsum(do o)),
comes from the final lse and the backward's delta in torch: [b, n_head, s] elementwise work.
"""

from __future__ import annotations

import torch

from ._utils import LOG2_E, check_device, device_arch
from .attention import forward_pass
from .attention_bwd import backward_launches
from .attention_tiles import check_segments, check_shapes, score_args, window_args


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    offset: int = 0,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [b, n_head, s, d], dk and dv [b, n_kv, s, d] in the inputs' dtype, delta =
    rowsum(dout * out) [b, n_head, s] fp32), from the saved contiguous q, k, v, out, the
    base-2 lse [b, n_head, s] and the output gradient dout (and the checked segments under
    document masks, the sliding window and offset or None, scale and softcap or None)."""
    dout = dout.contiguous()
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    delta = torch.zeros_like(lse)
    if q.numel() == 0:
        return (*grads, delta)
    arch = device_arch(q.device)
    launches = backward_launches(
        q, k, v, out, lse, dout, delta, grads, causal, arch, segments, window, offset,
        scale=scale, softcap=softcap,
    )  # fmt: skip
    for launch in launches:
        launch.run()
    return (*grads, delta)


def base2_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The sink logits [n_head] as the forward kernel takes them: fp32, base 2, contiguous;
    raises ValueError unless they are one per query head of q."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"attention: sinks must be [n_head] = [{q.shape[1]}], got {list(sinks.shape)}"
        )
    return (sinks.detach().float() * LOG2_E).contiguous()


def sink_grad(sinks2: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sink [n_head] in fp32 from the base-2 sinks, the final base-2 lse and delta =
    rowsum(dout * out) [b, n_head, s]: the sink's probability in each row times its
    d loss / d logit, p_sink (0 - delta) (the sink gives no value), summed over the rows."""
    p_sink = torch.exp2(sinks2.view(1, -1, 1) - lse.float())
    return -(p_sink * delta.float()).sum(dim=(0, 2))


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, segments, window, scale, sinks, softcap, row_max):
        check_device(q, k, v, segments, sinks)
        check_shapes(q, k, v)
        window_args(window, 0, q.shape[2])  # bad options fail before any work
        score_args(q.shape[-1], scale, softcap)
        sinks2 = base2_sinks(sinks, q)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        segments = check_segments(q, None if segments is None else (segments, segments))
        options = dict(scale=scale, softcap=softcap, sinks=sinks2, row_max=row_max)
        out, lse = forward_pass(q, k, v, causal, segments, window=window, **options)
        ctx.save_for_backward(q, k, v, out, lse, sinks2)
        ctx.causal, ctx.segments, ctx.window = causal, segments, window
        ctx.scale, ctx.softcap, ctx.sinks_dtype = (
            scale,
            softcap,
            None if sinks is None else sinks.dtype,
        )
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks2 = ctx.saved_tensors
        dq, dk, dv, delta = attention_backward(
            q, k, v, out, lse, dout, ctx.causal, ctx.segments, ctx.window,
            scale=ctx.scale, softcap=ctx.softcap,
        )  # fmt: skip
        dsinks = None
        if sinks2 is not None and ctx.needs_input_grad[7]:
            dsinks = sink_grad(sinks2, lse, delta).to(ctx.sinks_dtype)
        return dq, dk, dv, None, None, None, None, dsinks, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    segments: torch.Tensor | None = None,
    window: int | None = None,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    row_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale, causal mask optional) v -> [b, n_head, s, dv] in q's dtype; scale
    1/sqrt(d) unless given.

    q [b, n_head, s, d], k [b, n_kv_head, s, d], v [b, n_kv_head, s, dv] with n_kv_head
    dividing n_head (grouped-query: each kv head serves n_head / n_kv_head consecutive query
    heads).
    segments [b, s] int (each position's document, non-decreasing along the sequence): a
    query sees the keys of its own document only, and the key blocks of other documents are
    skipped. window W (a sliding window): the query at i sees the keys at j with i - j < W
    only, and the key blocks out of every window are skipped. softcap c: the scores become
    c tanh(score / c) before the masks. sinks [n_head]: one logit per query head that joins
    every row's softmax denominator and gives no value (its gradient flows). row_max: fp32
    [b, n_head, s], contiguous, that the forward fills with each query's largest score (q.k
    times scale, after any soft-cap; -inf where it sees no key), or None. Raises ValueError
    for head dims the kernels cannot tile (attention_tiles.check_shapes), for a window below
    1, a soft-cap not above 0 and sinks of another shape.
    """
    return _AttentionFunction.apply(
        q, k, v, bool(causal), segments, window, scale, sinks, softcap, row_max
    )
