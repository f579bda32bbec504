"""The fp8 casts and GEMMs on the Triton kernels (megatronish_kernels' fp8_cast, fp8_amax and
fp8_gemm) where the recipe's kernels.backend resolves to "triton" for the operands (CUDA
tensors under auto or triton; CPU tensors under triton with TRITON_INTERPRET=1); elsewhere
megatronish.fp8.quantize and gemm emulate.

Not through megatronish.ops (whose layers import megatronish.fp8): `fused` reads
kernels.backend as ops.resolve_backend does.

The numerics are the emulation's: the casts give the same payloads and scales bit for bit, the
GEMMs the same products up to fp32 summation order. Tensorwise and rowwise GEMMs go to
torch._scaled_mm (cuBLAS and CUTLASS fp8 GEMMs, which take the reciprocal scales) where it
takes the shapes: sizes multiples of 16, rowwise from sm_90 and with bf16 output only; the
blockwise GEMMs, and the others where _scaled_mm does not take them, to fp8_gemm.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatronish.fp8 import granularity as groups
from megatronish.fp8.recipes import Granularity, Operand


@functools.cache
def _functions() -> Any:
    """megatronish_kernels.functions, or None without Triton."""
    try:
        from megatronish_kernels import functions
    except ImportError:
        return None
    return functions


def fused(backend: str, x: torch.Tensor) -> bool:
    """Whether the fp8 casts and GEMMs of x run on the kernels under `backend`, as
    megatronish.ops resolves it (which checks an explicit "triton" where a run starts):
    "triton" always, "auto" for CUDA tensors when Triton is installed, "torch" never."""
    if backend == "auto":
        return x.is_cuda and _functions() is not None
    return backend == "triton"


def amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """The amaxes of x [rows, K] at granularity, float32, to reduce over ranks before the
    cast: the tensorwise first pass; torch's amax for the other granularities."""
    if granularity == "tensor":
        return _functions().fp8_amax(x).reshape(())
    return groups.amax(x, granularity).to(torch.float32)


def cast(
    x: torch.Tensor,
    operand: Operand,
    power_of_2: bool,
    amax: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scale) of x [rows, K] cast as `operand`: from `scale` when given, else from
    `amax` when given (reduced over ranks), else from x itself (fused)."""
    return _functions().fp8_cast(x, operand.granularity, operand.dtype, power_of_2, amax, scale)


def _scaled_mm_takes(a: torch.Tensor, b: torch.Tensor, granularity: str, dtype) -> bool:
    if not a.is_cuda or granularity not in ("tensor", "row"):
        return False
    if any(size % 16 for size in (*a.shape, b.shape[0])):
        return False
    if granularity == "row":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0)
    return True


def product(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_operand: Operand, dtype
) -> torch.Tensor:
    """(a / sa) [M, K] (b / sb)^T [K, N] in dtype for payloads a, b [N, K] with their scales
    (a's granularity is b's, or tile where b's is block)."""
    granularity = b_operand.granularity
    if _scaled_mm_takes(a, b, granularity, dtype):
        # torch._scaled_mm takes a row-major A and a column-major B (b.t() of a row-major b)
        # with aligned leading dims: a transposed or unpacked payload view is copied first (the
        # Triton GEMM takes any strides).
        a, b = a.contiguous(), b.contiguous()
        scale_b = sb.reciprocal() if granularity == "tensor" else sb.reciprocal().t()
        return torch._scaled_mm(a, b.t(), scale_a=sa.reciprocal(), scale_b=scale_b, out_dtype=dtype)
    return _functions().fp8_gemm(a, b, sa, sb, dtype, b_block=granularity == "block")
