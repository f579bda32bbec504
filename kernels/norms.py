"""RMSNorm and LayerNorm over the last dim, forward and backward, as Triton kernels.

Shapes: x [..., h] is viewed as [rows, h]; weight and bias [h]; mean and rstd [rows] in fp32.

Forward: one program per row; the whole row (BLOCK = next power of two of h, tail masked) is
reduced in registers, and mean (LayerNorm only) and rstd are saved for the backward.
Backward: P = min(rows, 512) programs each loop over rows pid, pid + P, ...; each writes dx for
its rows and one fp32 partial sum of dweight (and dbias) into a [P, h] buffer, which torch then
sums over P. No atomics, so the weight gradient is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device, persistent_programs, row_block, row_warps


@triton.jit
def _norm_fwd_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    h,
    eps,
    w_offset,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    x = tl.load(X + row * h + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
    if IS_RMS:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / h + eps)
        y = x * rstd * w
    else:
        mean = tl.sum(x, axis=0) / h
        centered = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / h + eps)
        tl.store(MEAN + row, mean)
        y = centered * rstd * w
        if HAS_BIAS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * h + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    X,
    W,
    DY,
    DX,
    MEAN,
    RSTD,
    DW_PART,
    DB_PART,
    n_rows,
    h,
    w_offset,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < h
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(pid, n_rows, n_programs):
        offset = tl.cast(row, tl.int64) * h
        x = tl.load(X + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offset + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            x_hat = x * rstd
        else:
            x_hat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        w_dy = w * dy
        # dx = rstd * (w*dy - x_hat * mean(x_hat * w*dy) [- mean(w*dy) for LayerNorm])
        correction = x_hat * (tl.sum(x_hat * w_dy, axis=0) / h)
        if not IS_RMS:
            correction += tl.sum(w_dy, axis=0) / h
        dx = (w_dy - correction) * rstd
        tl.store(DX + offset + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PART + pid * h + cols, dw_acc, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * h + cols, db_acc, mask=mask)


def norm_forward_launch(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    is_rms: bool,
    offset: float = 0.0,
) -> Launch:
    """The forward kernel's launch on contiguous x2d [rows, h] into y, mean and rstd [rows];
    the rows scaled by offset + weight (in fp32)."""
    n_rows, h = x2d.shape
    block = row_block(h, "rms_norm" if is_rms else "layer_norm")
    return Launch(
        _norm_fwd_kernel,
        grid=(n_rows,),
        args=(x2d, weight, bias if bias is not None else weight, y, mean, rstd, h, eps, offset),
        constexprs=dict(IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK=block),
        num_warps=row_warps(block),
    )


def norm_backward_launch(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    dy2d: torch.Tensor,
    dx: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dw_part: torch.Tensor,
    db_part: torch.Tensor | None,
    is_rms: bool,
    offset: float = 0.0,
) -> Launch:
    """The backward kernel's launch: dx [rows, h] and the [programs, h] fp32 partials of
    dweight (and dbias, when db_part is given) from the saved x2d, mean and rstd; offset as in
    norm_forward_launch (dweight does not depend on it)."""
    n_rows, h = x2d.shape
    block = row_block(h, "norm backward")
    db_arg = db_part if db_part is not None else dw_part
    return Launch(
        _norm_bwd_kernel,
        grid=(dw_part.shape[0],),
        args=(x2d, weight, dy2d, dx, mean, rstd, dw_part, db_arg, n_rows, h, offset),
        constexprs=dict(IS_RMS=is_rms, HAS_BIAS=db_part is not None, BLOCK=block),
        num_warps=row_warps(block),
    )


def _check_param(name: str, param: torch.Tensor | None, h: int) -> None:
    if param is not None and tuple(param.shape) != (h,):
        raise ValueError(
            f"{name} must have shape [{h}] (the last dim of x), got {list(param.shape)}"
        )


class _NormFunction(torch.autograd.Function):
    """Shared autograd wrapper: RMSNorm when is_rms, otherwise LayerNorm."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, is_rms: bool, offset: float = 0.0):
        check_device(x, weight, bias)
        h = x.shape[-1]
        what = "rms_norm" if is_rms else "layer_norm"
        _check_param(f"{what} weight", weight, h)
        _check_param(f"{what} bias", bias, h)
        row_block(h, what)  # a clear error for a row too wide, before any allocation
        x2d = x.contiguous().view(-1, h)
        weight = weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        n_rows = x2d.shape[0]
        y = torch.empty_like(x2d)
        rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
        mean = rstd if is_rms else torch.empty_like(rstd)
        if n_rows > 0:
            norm_forward_launch(x2d, weight, bias, y, mean, rstd, eps, is_rms, offset).run()
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.is_rms, ctx.offset = is_rms, offset
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        n_rows, h = x2d.shape
        dy2d = dy.contiguous().view(-1, h)
        dx = torch.empty_like(x2d)
        programs = persistent_programs(n_rows)
        dw_part = torch.zeros(programs, h, device=x2d.device, dtype=torch.float32)
        db_part = torch.zeros_like(dw_part) if bias is not None else None
        if n_rows > 0:
            launch = norm_backward_launch(
                x2d, weight, dy2d, dx, mean, rstd, dw_part, db_part, ctx.is_rms, ctx.offset
            )
            launch.run()
        dweight = dw_part.sum(0).to(weight.dtype)
        dbias = db_part.sum(0).to(bias.dtype) if db_part is not None else None
        return dx.view(ctx.x_shape), dweight, dbias, None, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """x [..., h] * rsqrt(mean(x^2) + eps) * (offset + weight [h]); fp32 math (the offset
    added to the weight in fp32: Gemma's and Qwen3.5's 1 + w), output in x's dtype."""
    return _NormFunction.apply(x, weight, None, float(eps), True, float(offset))


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """(x - mean) * rstd * weight + bias over the last dim of x [..., h]; bias may be None;
    fp32 math, output in x's dtype."""
    return _NormFunction.apply(x, weight, bias, float(eps), False)
