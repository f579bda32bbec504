"""Casting GEMM operands to fp8 with their scales, exact across tensor parallelism: a scale
whose group of elements is split over the tp ranks (a tensorwise scale of a sharded tensor, a
rowwise scale of rows split along K) takes the amax over the whole group, all-reduced (MAX)
over the tp group. The operands of one GEMM share one all-reduce: their amaxes in float32
(exact), concatenated."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.distributed import comm
from megatronish.fp8 import granularity as groups
from megatronish.fp8 import kernels
from megatronish.fp8.recipes import Operand
from megatronish.fp8.scaling import amax_to_scale, cast_to_fp8, dequantize


@dataclass(frozen=True)
class Quantized:
    """An operand [rows, K] in fp8: its payload and float32 scales (granularity layout)."""

    payload: torch.Tensor
    scale: torch.Tensor
    operand: Operand

    def values(self) -> torch.Tensor:
        """The float32 values the payload stands for, [rows, K]."""
        shape = self.payload.shape
        return dequantize(self.payload, groups.expand(self.scale, self.operand.granularity, shape))


@dataclass(frozen=True)
class Cast:
    """One operand to cast: x [rows, K] as `operand`. rows_split, k_split: whether that
    dimension of x is split over the tp group (the whole tensor spans the ranks). `scale`: one
    already known (a tensorwise scale computed for an earlier GEMM of the same tensor)."""

    x: torch.Tensor
    operand: Operand
    rows_split: bool = False
    k_split: bool = False
    scale: torch.Tensor | None = None

    @property
    def spans_ranks(self) -> bool:
        """Whether a scaling group of x holds elements of other tp ranks (never for tiles
        and blocks: a shard holds whole ones, see config.derive)."""
        granularity = self.operand.granularity
        if granularity == "tensor":
            return self.rows_split or self.k_split
        return granularity == "row" and self.k_split


def quantize(
    casts: list[Cast], power_of_2: bool, group: dist.ProcessGroup | None, backend: str = "auto"
) -> list[Quantized]:
    """Each cast's operand in fp8. The amaxes of the casts whose scaling groups span the tp
    ranks go through one MAX all-reduce over `group` (none when no cast needs it, or the
    group has one rank). Where `backend` (kernels.backend) runs the fp8 kernels
    (megatronish.fp8.kernels) the casts are fused, with the same results."""
    fused = kernels.fused(backend, casts[0].x)
    ranks = comm.group_size(group)
    amaxes = [
        None
        if cast.scale is not None or (fused and not (cast.spans_ranks and ranks > 1))
        else (kernels.amax if fused else groups.amax)(cast.x, cast.operand.granularity)
        for cast in casts
    ]
    reduced = [i for i, cast in enumerate(casts) if cast.scale is None and cast.spans_ranks]
    if reduced and ranks > 1:
        flat = torch.cat([amaxes[i].to(torch.float32).reshape(-1) for i in reduced])
        comm.all_reduce(flat, group, op=dist.ReduceOp.MAX)
        for i, part in zip(reduced, flat.split([amaxes[i].numel() for i in reduced])):
            amaxes[i] = part.view(amaxes[i].shape)
    out = []
    for cast, amax in zip(casts, amaxes):
        operand = cast.operand
        if fused:
            payload, scale = kernels.cast(cast.x, operand, power_of_2, amax, cast.scale)
            out.append(Quantized(payload, scale, operand))
            continue
        if cast.scale is not None:
            scale = cast.scale
        else:
            scale = amax_to_scale(amax, operand.dtype, power_of_2)
        expanded = groups.expand(scale, operand.granularity, cast.x.shape)
        out.append(Quantized(cast_to_fp8(cast.x, expanded, operand.dtype), scale, operand))
    return out
