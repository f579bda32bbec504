"""A GPU target's resources and a compiled kernel's use of them: registers, warps and blocks an
SM holds, shared memory per block and per SM; a cubin's registers, stack, local and static
shared memory (`cuobjdump --dump-resource-usage`, with the cuobjdump Triton ships); and the
occupancy those allow, as the CUDA occupancy calculator estimates it. compile_check.py measures
every compiled kernel with them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Registers per SM, the most warps and blocks an SM holds: the same on sm_80 and sm_90 (an
# sm_89 SM holds 48 warps: Arch.max_warps).
REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 64, 32
RESERVED_SHARED = 1024  # shared memory the CUDA runtime keeps per block (sm_80 and later)


@dataclass(frozen=True)
class Arch:
    """A GPU target: its compute capability, shared memory per block and per SM (bytes), and
    the most warps an SM holds."""

    name: str
    capability: int
    shared_limit: int
    shared_per_sm: int
    max_warps: int = MAX_WARPS_PER_SM


def cuobjdump() -> str:
    """The cuobjdump that Triton ships (or the one its knobs point to)."""
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED (static) and LOCAL of the one kernel in a cubin, from cuobjdump
    --dump-resource-usage."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run(
            [cuobjdump(), "--dump-resource-usage", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    if "REG" not in usage:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return {key: int(value) for key, value in usage.items()}


def occupancy_warps(registers: int, shared_bytes: int, num_warps: int, arch: Arch) -> int:
    """Warps an SM of arch holds at once (of arch.max_warps): the CUDA occupancy calculator's
    estimate from the registers (allocated per warp in units of 256) and the shared memory of a
    block (plus the 1 KB the runtime keeps per block)."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    blocks = min(
        REGISTERS_PER_SM // regs_per_warp // num_warps,
        arch.max_warps // num_warps,
        MAX_BLOCKS_PER_SM,
    )
    if shared_bytes:
        blocks = min(blocks, arch.shared_per_sm // (shared_bytes + RESERVED_SHARED))
    return blocks * num_warps
