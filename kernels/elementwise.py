"""SwiGLU, GeGLU (the tanh GELU of the gate) and bias + GELU (tanh), forward and backward, as flat
elementwise Triton kernels.

Shapes: gate, up, x [..., f] are viewed as flat arrays of n elements; bias [f] is broadcast over
the last dim (element i uses bias[i % f]).

Each program handles BLOCK consecutive elements with an int64 offset, so n may pass 2^31. The
backward kernels recompute silu / the GELU tanh term from the saved inputs instead of keeping
activations. GELU's tanh form is written as x * sigmoid(2 z), which equals
0.5 x (1 + tanh(z)) with z = sqrt(2/pi) (x + 0.044715 x^3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device

_BLOCK = 1024
_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _gate_activation(gate, k, GELU: tl.constexpr):
    """(act(gate), d act / d gate) in fp32: silu, or with GELU the tanh GELU (k: sqrt(2/pi))."""
    if GELU:
        s = tl.sigmoid(2.0 * k * (gate + 0.044715 * gate * gate * gate))
        return gate * s, s + gate * s * (1.0 - s) * 2.0 * k * (1.0 + 0.134145 * gate * gate)
    sig = tl.sigmoid(gate)
    # d silu / d gate = sig * (1 + gate * (1 - sig))
    return gate * sig, sig * (1.0 + gate * (1.0 - sig))


@triton.jit
def _swiglu_fwd_kernel(G, U, OUT, n, k, GELU: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _gate_activation(gate, k, GELU)
    tl.store(OUT + offs, (act * up).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(G, U, DOUT, DG, DU, n, k, GELU: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    act, dact = _gate_activation(gate, k, GELU)
    tl.store(DG + offs, (dout * up * dact).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dout * act).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_input(X, BIAS, offs, mask, f, HAS_BIAS: tl.constexpr):
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + offs % f, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _bias_gelu_fwd_kernel(X, BIAS, OUT, n, f, k, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _gelu_input(X, BIAS, offs, mask, f, HAS_BIAS)
    out = x * tl.sigmoid(2.0 * k * (x + 0.044715 * x * x * x))
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(X, BIAS, DOUT, DX, n, f, k, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _gelu_input(X, BIAS, offs, mask, f, HAS_BIAS)
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(2.0 * k * (x + 0.044715 * x * x * x))
    # d/dx [x s(2z)] = s + x s (1 - s) 2 dz/dx, dz/dx = k (1 + 3 * 0.044715 x^2)
    grad = s + x * s * (1.0 - s) * 2.0 * k * (1.0 + 0.134145 * x * x)
    tl.store(DX + offs, (dout * grad).to(DX.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def swiglu_launch(
    gate: torch.Tensor,
    up: torch.Tensor,
    out: torch.Tensor,
    grads: tuple | None = None,
    gelu: bool = False,
) -> Launch:
    """The forward launch (grads None: out = silu(gate) * up, or with gelu the tanh GELU's
    GeGLU) or, with dout as `out` and grads = (dgate, dup), the backward launch; all
    contiguous, of one shape."""
    n = gate.numel()
    constexprs = dict(GELU=gelu, BLOCK=_BLOCK)
    if grads is None:
        args = (gate, up, out, n, _SQRT_2_OVER_PI)
        return Launch(_swiglu_fwd_kernel, _grid(n), args, constexprs)
    args = (gate, up, out, *grads, n, _SQRT_2_OVER_PI)
    return Launch(_swiglu_bwd_kernel, _grid(n), args, constexprs)


def bias_gelu_launch(
    x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, dx: torch.Tensor | None = None
) -> Launch:
    """The forward launch (dx None: out = gelu(x + bias)) or, with dout as `out`, the backward
    launch into dx; x [..., f] contiguous, bias [f] or None."""
    n = x.numel()
    f = x.shape[-1] if x.dim() > 0 else 1
    constexprs = dict(HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    bias_arg = bias if bias is not None else x
    if dx is None:
        args = (x, bias_arg, out, n, f, _SQRT_2_OVER_PI)
        return Launch(_bias_gelu_fwd_kernel, _grid(n), args, constexprs)
    args = (x, bias_arg, out, dx, n, f, _SQRT_2_OVER_PI)
    return Launch(_bias_gelu_bwd_kernel, _grid(n), args, constexprs)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, gelu=False):
        check_device(gate, up)
        name = "geglu" if gelu else "swiglu"
        if gate.shape != up.shape:
            raise ValueError(f"{name}: gate {list(gate.shape)} and up {list(up.shape)} differ")
        if gate.dtype != up.dtype:
            raise ValueError(f"{name}: gate is {gate.dtype} and up is {up.dtype}; use one dtype")
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        if gate.numel() > 0:
            swiglu_launch(gate, up, out, gelu=gelu).run()
        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n > 0:
            swiglu_launch(gate, up, dout, (dgate, dup), gelu=ctx.gelu).run()
        return dgate, dup, None


class _BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        check_device(x, bias)
        f = x.shape[-1] if x.dim() > 0 else 1
        if bias is not None and tuple(bias.shape) != (f,):
            raise ValueError(f"bias_gelu: bias must have shape [{f}], got {list(bias.shape)}")
        x = x.contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = torch.empty_like(x)
        if x.numel() > 0:
            bias_gelu_launch(x, bias, out).run()
        ctx.save_for_backward(x, bias)
        ctx.f = f
        return out

    @staticmethod
    def backward(ctx, dout):
        x, bias = ctx.saved_tensors
        dout = dout.contiguous()
        dx = torch.empty_like(x)
        if x.numel() > 0:
            bias_gelu_launch(x, bias, dout, dx).run()
        dbias = None
        if bias is not None:
            dbias = dx.view(-1, ctx.f).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up of one shape and dtype; fp32 math, output in their dtype."""
    return _SwiGLUFunction.apply(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (tanh approximation) for gate, up of one shape and dtype; fp32 math,
    output in their dtype."""
    return _SwiGLUFunction.apply(gate, up, True)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu(x + bias) with the tanh approximation; x [..., f], bias [f] or None. The bias
    gradient is the fp32 sum of dx over all leading dims."""
    return _BiasGeluFunction.apply(x, bias)
