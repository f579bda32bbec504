"""Helpers shared by the kernel modules: device checks, launch settings, dtype mapping."""

from __future__ import annotations

import os

import torch
import triton

# Tensors are made contiguous before every launch, so a row of h elements starts at row * h.
# Widest row a one-row-per-program kernel keeps in registers (64k fp32 = 256 KiB per program).
MAX_ROW_BLOCK = 65536
LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * LOG2_E)


# triton.jit reads TRITON_INTERPRET when a kernel is defined, i.e. when this package is imported:
# from then on the kernels are either interpreted (CPU tensors) or compiled (CUDA tensors).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """True when the kernels were defined under Triton's CPU interpreter (TRITON_INTERPRET=1
    at import time)."""
    return _INTERPRETED


def check_device(*tensors: torch.Tensor | None) -> None:
    """Raises RuntimeError when a tensor cannot reach a Triton kernel (CPU without the interpreter,
    or tensors on different devices)."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    for tensor in present:
        if tensor.device != device:
            raise RuntimeError(f"kernel inputs are on {device} and {tensor.device}: use one device")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            f"megatronish_kernels is imported for CPU tensors (got {device})"
        )


def row_block(h: int, what: str) -> int:
    """BLOCK for kernels that hold one row of h elements: the next power of two of h."""
    block = triton.next_power_of_2(h)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"{what}: rows of {h} elements exceed the supported {MAX_ROW_BLOCK}")
    return block


def row_warps(block: int) -> int:
    """num_warps for a program that reduces a row of `block` elements."""
    if block >= 16384:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    if block >= 1024:
        return 4
    return 2


def persistent_programs(n_rows: int) -> int:
    """Programs of a backward that loops over rows and writes one fp32 weight-grad partial each.

    A function of the shape only (never of the device), so every rank reduces the partials in
    the same order and gets bit-identical weight gradients.
    """
    return max(1, min(n_rows, 512))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 ("ieee") for fp32 inputs, so results match torch with
    TF32 off; the native tensor-core path for 16-bit inputs (the string is then ignored)."""
    return "ieee" if dtype == torch.float32 else "tf32"
