"""Amax and scale layouts of the four granularities (megatronish.fp8.recipes), for an operand
read as a matrix [rows, K]: tensor -> a scalar, row -> [rows, 1], tile -> [rows, ceil(K / 128)],
block -> [ceil(rows / 128), ceil(K / 128)]. A tile or block at the end of a dimension that is
not a multiple of 128 is narrower (it holds what is left).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatronish.fp8.recipes import Granularity

BLOCK = 128
"""The width of a tile and the side of a block."""


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """max |x| over each scaling group of x [rows, K], in x's dtype, in the layout above (zeros
    for an empty x: an expert's run of no rows, megatronish.fp8.grouped)."""
    if x.numel() == 0:
        return x.new_zeros(layout(x.shape, granularity))
    magnitude = x.abs()
    if granularity == "tensor":
        return torch.max(magnitude)
    if granularity == "row":
        return torch.amax(magnitude, dim=1, keepdim=True)
    rows, k = magnitude.shape
    kb = _blocks(k)
    if granularity == "tile":  # zeros pad the last tile: they never raise an amax
        padded = F.pad(magnitude, (0, kb * BLOCK - k))
        return padded.view(rows, kb, BLOCK).amax(dim=2)
    if granularity == "block":
        rb = _blocks(rows)
        padded = F.pad(magnitude, (0, kb * BLOCK - k, 0, rb * BLOCK - rows))
        return padded.view(rb, BLOCK, kb, BLOCK).amax(dim=(1, 3))
    raise ValueError(f"unknown granularity {granularity!r}")


def layout(shape: torch.Size, granularity: Granularity) -> tuple[int, ...]:
    """The shape of the scales of an operand of `shape` [rows, K] at granularity."""
    rows, k = shape
    return {
        "tensor": (),
        "row": (rows, 1),
        "tile": (rows, _blocks(k)),
        "block": (_blocks(rows), _blocks(k)),
    }[granularity]


def expand(scale: torch.Tensor, granularity: Granularity, shape: torch.Size) -> torch.Tensor:
    """scale (in its granularity's layout) as a tensor that broadcasts against shape [rows, K]."""
    if granularity in ("tensor", "row"):
        return scale
    rows, k = shape
    if granularity == "tile":
        return scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    return scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :k]
