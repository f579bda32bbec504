"""Rotary position embedding (rotate-half pairing, as Llama in transformers) as a Triton kernel
that reads its cos and sin from a table.

Shapes: x [b, n, s, d] is viewed as [rows = b * n * s, d]; row r takes table row r % s.
cos, sin [s, d/2] fp32 (table row i: x's i-th position, 0..s-1 or given positions), or
[b, s, d/2] (each sequence its own, as document masks restart positions: row r takes table
row (r // (n s)) s + r % s). The caller builds the table (megatronish.ops.rope.rope_table, the
one source of the frequencies and of the attention factor the table is scaled by; the kernels
import nothing from megatronish). Dim i pairs with dim i + d/2:

    out[i]       = x[i] cos - x[i + d/2] sin
    out[i + d/2] = x[i + d/2] cos + x[i] sin

The backward is the same kernel with sin negated: the transpose of the rotation, times the
same factor when the table is scaled (YaRN's attention factor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device


@triton.jit
def _rope_kernel(
    X,
    OUT,
    COS,
    SIN,
    n_rows,
    seq_len,
    half,
    sample_rows,
    table_stride,
    INVERSE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
    x_offs = rows[:, None] * (2 * half) + cols[None, :]
    # table_stride: s for a table per sequence ([b, s, d/2]), 0 for one shared table.
    table_rows = (rows // sample_rows) * table_stride + rows % seq_len
    table_offs = table_rows[:, None] * half + cols[None, :]
    x1 = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(COS + table_offs, mask=mask, other=0.0)
    sin = tl.load(SIN + table_offs, mask=mask, other=0.0)
    if INVERSE:
        sin = -sin
    tl.store(OUT + x_offs, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + x_offs + half, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


def rope_launch(
    x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> Launch:
    """The kernel's launch on contiguous x [b, n, s, d] into out, with the tables cos, sin
    ([s, d/2], or [b, s, d/2]: one per sequence)."""
    seq_len, head_dim = x.shape[-2], x.shape[-1]
    half = head_dim // 2
    n_rows = x.numel() // head_dim
    block_h = triton.next_power_of_2(half)
    block_r = max(1, 1024 // block_h)
    sample_rows = x.shape[1] * seq_len  # rows of one sequence (all its heads)
    table_stride = seq_len if cos.dim() == 3 else 0
    return Launch(
        _rope_kernel,
        grid=(triton.cdiv(n_rows, block_r),),
        args=(x, out, cos, sin, n_rows, seq_len, half, sample_rows, table_stride),
        constexprs=dict(INVERSE=inverse, BLOCK_R=block_r, BLOCK_H=block_h),
        num_warps=4,
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() > 0:
        rope_launch(x, out, cos, sin, inverse).run()
    return out


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        check_device(x)
        if x.dim() != 4:
            raise ValueError(f"rope: x must be [b, n, s, d], got shape {list(x.shape)}")
        head_dim = x.shape[-1]
        if head_dim % 2 != 0:
            raise ValueError(f"rope: head dim must be even, got {head_dim}")
        b, _, s, _ = x.shape
        shapes = ([s, head_dim // 2], [b, s, head_dim // 2])
        if cos.dtype != torch.float32 or list(cos.shape) not in shapes or cos.shape != sin.shape:
            raise ValueError(
                f"rope: cos and sin must be fp32 {shapes[0]} or {shapes[1]}, got {cos.dtype} "
                f"{list(cos.shape)} and {list(sin.shape)}"
            )
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dout):
        cos, sin = ctx.saved_tensors
        return _rotate(dout, cos, sin, inverse=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [b, n, s, d] by the table cos, sin (fp32 [s, d/2], or [b, s, d/2]:
    one per sequence), rotate-half pairing; fp32 math, output in x's dtype."""
    return _RopeFunction.apply(x, cos, sin)
