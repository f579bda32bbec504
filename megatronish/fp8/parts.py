"""The logical matrices of a fused linear layer's output rows: the attention's query, key and
value projections, one weight here, three linears in transformers and torchtitan. A scale whose
group runs along those rows is taken over each logical matrix alone, as the three separate
layers take it: under rowwise, the input-gradient GEMM's scales (it sums over the rows: one per
token of the output gradient and one per input feature of the weight, each per matrix), its
product then the sum of one GEMM per matrix.

Blockwise tiles and blocks run along those rows too (the weight's 128 x 128 blocks in the
forward, the output gradient's and the weight's in the input gradient): where a matrix's rows
are not whole 128s (a head dim not a multiple of 128) a tile of the fused rows would hold rows
of two matrices, so each matrix's are tiled from its own first row, as a separate layer's are;
where they are whole 128s the fused tiles are those already. Tensorwise keeps one scale for the
fused weight and one for its output gradient, as Megatron-LM's fused QKV does.

The sizes describe one unit of rows that repeats along the layer's output (the fused qkv: per
key-value group its query heads', its key head's and its value head's rows); a tp rank's block
holds whole units, so a rank's rows of a matrix are its shard of that matrix, and a scale
over a matrix's rows split over tp is the MAX all-reduce of the ranks' amaxes, as for a whole
tensor (megatronish.fp8.quantize).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatronish.fp8.granularity import BLOCK
from megatronish.fp8.recipes import Granularity


@dataclass(frozen=True)
class Parts:
    """The rows of each logical matrix in one repeating unit of a layer's output rows."""

    sizes: tuple[int, ...]

    def index(self, rows: int, device: torch.device) -> list[torch.Tensor]:
        """The positions of each matrix's rows among `rows` (whole units), in order."""
        return _index(self.sizes, rows, device)


@functools.lru_cache(maxsize=64)
def _index(sizes: tuple[int, ...], rows: int, device: torch.device) -> list[torch.Tensor]:
    unit = sum(sizes)
    if rows % unit:
        raise ValueError(f"{rows} output rows are not whole units of the parts {sizes}")
    starts = torch.arange(0, rows, unit, device=device)[:, None]
    out, offset = [], 0
    for size in sizes:
        out.append((starts + offset + torch.arange(size, device=device)).reshape(-1))
        offset += size
    return out


def splitting(parts: Parts | None, granularity: Granularity, rows: bool = False) -> Parts | None:
    """parts where an operand's scaling groups at granularity run along the fused rows across a
    matrix's boundary, else None. rows False: the fused rows are the operand's K (the
    input-gradient GEMM's output gradient and weight); True: its rows (the weight's in the
    forward, where only blocks span rows)."""
    if parts is None or len(parts.sizes) == 1 or granularity == "tensor":
        return None
    if granularity == "row":
        return None if rows else parts
    return parts if any(size % BLOCK for size in parts.sizes) else None


def along_k(x: torch.Tensor, parts: Parts | None) -> list[torch.Tensor]:
    """x [rows, K] as each logical matrix's columns [rows, K_p] (K the fused rows of the
    parts), or [x] for parts None."""
    if parts is None:
        return [x]
    return [x.index_select(1, index) for index in parts.index(x.shape[1], x.device)]


def along_rows(w: torch.Tensor, parts: Parts | None) -> list[torch.Tensor]:
    """w [rows, K] as each logical matrix's rows [rows_p, K], or [w] for parts None."""
    if parts is None:
        return [w]
    return [w.index_select(0, index) for index in parts.index(w.shape[0], w.device)]
