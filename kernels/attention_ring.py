"""One block of ring attention on the flash kernels, without autograd: the forward with its
log-sum-exp (merged with the other blocks by the caller), and the backward from the ring's final
output and log-sum-exp. Shapes as in attention.py (q, k [.., d], v and the output [.., dv]);
lse here in natural log, the kernels' base 2 converted at the boundary.
"""

from __future__ import annotations

import torch

from ._utils import LOG2_E, check_device
from .attention import forward_pass
from .attention_autograd import attention_backward
from .attention_tiles import check_segments, check_shapes


def attention_block_forward(
    q,
    k,
    v,
    causal: bool,
    segments=None,
    window: int | None = None,
    offset: int = 0,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of ring attention, no autograd: (out fp32 (fp64 for fp64 inputs), to be merged
    with other blocks; lse [b, n_head, s] fp32 in natural log), shapes as in attention.attention;
    segments: None, or the (queries', keys') [b, s] under document masks; window: a sliding
    window over queries `offset` positions after the keys, or None (a row that sees no key
    here gets out 0 and lse -inf); scale (None: 1/sqrt(d)) and softcap (None: none) as in
    attention.attention. Sinks are the ring's to merge, once, after its blocks."""
    check_device(q, k, v)
    check_shapes(q, k, v)
    out_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    segments = check_segments(q, segments)
    options = dict(scale=scale, softcap=softcap)
    out, lse2 = forward_pass(q, k, v, causal, segments, out_dtype, window, offset, **options)
    return out, lse2 * (1.0 / LOG2_E)


def attention_block_backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    causal: bool,
    segments=None,
    window=None,
    offset: int = 0,
    *,
    scale: float | None = None,
    softcap: float | None = None,
):
    """The flash backward of one block from a given output `out` and natural-log `lse` (a ring's
    final ones, so rowsum(dout * out) is the global one): dq, dk, dv in the inputs' dtype;
    segments, window, offset, scale and softcap as in attention_block_forward."""
    check_device(q, k, v, out, dout)
    check_shapes(q, k, v)
    lse2 = (lse.float() * LOG2_E).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    segments = check_segments(q, segments)
    out = out.contiguous()
    options = dict(scale=scale, softcap=softcap)
    grads = attention_backward(
        q, k, v, out, lse2, dout, causal, segments, window, offset, **options
    )
    return grads[:3]
