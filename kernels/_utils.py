"""Helpers shared by the kernel modules: device checks, launch settings, dtype mapping, and
`Launch`, the one record of a kernel launch that the launchers run and the compile check
(compile_check.py) compiles for a GPU target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the jit function, its grid, its runtime arguments (tensors and
    scalars, in the kernel's order), its constexprs and the launch options.

    Every launcher builds its launches through a `*_launch` function of its module and runs
    them; compile_check.py calls the same functions on meta tensors and compiles the result
    for a GPU target, so the check compiles exactly what a GPU run launches. num_warps and
    num_stages are always given (Triton's CUDA defaults are 4 and 3).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        """The jit function's name, e.g. _attn_fwd_kernel."""
        return self.kernel.__name__

    def run(self) -> None:
        """Launches the kernel (compiled on CUDA, interpreted under TRITON_INTERPRET=1)."""
        self.kernel[self.grid](
            *self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages
        )


def device_arch(device: torch.device) -> int:
    """The compute capability of a CUDA device as one number (80 for an A100, 90 for an H100),
    which picks tiles where one choice cannot serve every GPU; 0 for any other device (the
    interpreter, whose tiles do not depend on it)."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


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
