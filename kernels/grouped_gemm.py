"""Grouped GEMM: rows of x sorted by group, each group times its own matrix (the expert FFNs of
a mixture-of-experts layer), forward and backward, with no host synchronisation.

Shapes: x [A, k], rows offsets[g - 1]:offsets[g] belong to group g (offsets [G], cumulative
ends, int32 or int64, on x's device; a group may be empty); w [G, k, n] with any strides (the
callers pass the transpose view of a [G, n, k] weight); y [A, n], y[group g] = x[group g] @
w[g].

Forward and dx run one kernel: a grid of cdiv(A, BLOCK_M) + G row tiles (an upper bound on the
tiles over all groups) x cdiv(n, BLOCK_N); each program walks the group offsets to find its
group and tile, and leaves when it has none. dw[g] = x_g^T dy_g runs one program per (group,
k tile, n tile), looping over the group's rows. Accumulation in fp32 (exact fp32 dots for fp32
inputs); results in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device, dot_precision, interpreting


def gemm_tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of both kernels: 64, 64, 32 (under the interpreter too).
    fp32 on CUDA takes 32-row tiles: its exact-fp32 dots run on FMA units, and 64 x 64 with 4
    warps needs 255 registers and spills on sm_80 (kernel_report.py); 32 x 64 needs under 100.
    """
    if dtype == torch.float32 and not interpreting():
        return 32, 64, 32
    return 64, 64, 32


@triton.jit
def _grouped_mm_kernel(
    X,
    W,
    Y,
    OFFS,
    G,
    N,
    K,
    sxm,
    sxk,
    swg,
    swk,
    swn,
    sym,
    syn,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = 0
    found = 0
    group = 0
    row0 = 0
    row_end = 0
    for g in range(0, G):
        end = tl.load(OFFS + g).to(tl.int32)
        tiles = tl.cdiv(end - start, BLOCK_M)
        hit = (found == 0) & (tile < tiles)
        group = tl.where(hit, g, group)
        row0 = tl.where(hit, start + tile * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        tile = tl.where(found == 0, tile - tiles, tile)
        found = tl.where(hit, 1, found)
        start = end
    if found == 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < row_end, cols < N
    rows64 = rows.to(tl.int64)
    w_base = W + group.to(tl.int64) * swg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            X + rows64[:, None] * sxm + ks[None, :] * sxk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_base + ks[:, None] * swk + cols[None, :] * swn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=PREC)
    out = Y + rows64[:, None] * sym + cols[None, :] * syn
    tl.store(out, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_dw_kernel(
    X,
    DY,
    DW,
    OFFS,
    N,
    K,
    sxm,
    sxk,
    sdm,
    sdn,
    swg,
    swk,
    swn,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    group = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    end = tl.load(OFFS + group).to(tl.int32)
    start = tl.where(group > 0, tl.load(OFFS + group - 1, mask=group > 0, other=0), 0)
    start = start.to(tl.int32)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok, col_ok = ks < K, cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        rows64 = rows.to(tl.int64)
        a = tl.load(  # [BLOCK_K, BLOCK_M]: x_g transposed
            X + rows64[None, :] * sxm + ks[:, None] * sxk,
            mask=k_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        d = tl.load(
            DY + rows64[:, None] * sdm + cols[None, :] * sdn,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(a, d, input_precision=PREC)
    out = DW + group.to(tl.int64) * swg + ks[:, None] * swk + cols[None, :] * swn
    tl.store(out, acc.to(DW.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def grouped_mm_launch(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor
) -> Launch:
    """The launch of y [A, n] = x [A, k] grouped times w [G, k, n] (any strides)."""
    rows, k = x.shape
    groups, _, n = w.shape
    block_m, block_n, block_k = gemm_tiles(x.dtype)
    args = (
        x,
        w,
        y,
        offsets,
        groups,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        y.stride(0),
        y.stride(1),
    )
    return Launch(
        _grouped_mm_kernel,
        grid=(triton.cdiv(rows, block_m) + groups, triton.cdiv(n, block_n)),
        args=args,
        constexprs=dict(
            PREC=dot_precision(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k
        ),
    )


def grouped_dw_launch(
    x: torch.Tensor, dy: torch.Tensor, dw: torch.Tensor, offsets: torch.Tensor
) -> Launch:
    """The launch of dw [G, k, n]: dw[g] = x_g^T dy_g for x [A, k], dy [A, n]."""
    k, n = x.shape[1], dy.shape[1]
    block_m, block_n, block_k = gemm_tiles(x.dtype)
    args = (
        x,
        dy,
        dw,
        offsets,
        n,
        k,
        x.stride(0),
        x.stride(1),
        dy.stride(0),
        dy.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
    )
    return Launch(
        _grouped_dw_kernel,
        grid=(dw.shape[0], triton.cdiv(k, block_k), triton.cdiv(n, block_n)),
        args=args,
        constexprs=dict(
            PREC=dot_precision(x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k
        ),
    )


def _forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    y = torch.empty((rows, w.shape[2]), dtype=x.dtype, device=x.device)
    if rows == 0 or w.shape[2] == 0:
        return y
    grouped_mm_launch(x, w, y, offsets).run()
    return y


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, groups: int):
    dw = torch.empty((groups, x.shape[1], dy.shape[1]), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return dw.zero_()
    grouped_dw_launch(x, dy, dw, offsets).run()
    return dw


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _forward(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _forward(dy, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(x, dy, offsets, w.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y [A, n]: rows offsets[g-1]:offsets[g] of x [A, k] times w[g] ([G, k, n], any strides)."""
    check_device(x, w, offsets)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or offsets.numel() != w.shape[0]:
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, offsets {tuple(offsets.shape)}"
        )
    return _GroupedMM.apply(x.contiguous(), w, offsets)
