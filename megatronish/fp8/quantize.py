"""Casting GEMM operands to fp8 with their scales, exact across tensor and context parallelism:
a scale whose group of elements is split over ranks (a tensorwise scale of a tensor sharded
over tp or whose tokens are split over cp, a rowwise scale of rows split along K) takes the
amax over the whole group, all-reduced (MAX) over the ranks that split it: the tp group, the cp
group, or the tp x cp group where both do. The operands of one GEMM share one all-reduce: their
amaxes in float32 (exact), concatenated, over the union of the groups any of them needs (an
operand replicated over the others reduces to its own amax there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatronish.distributed import comm
from megatronish.fp8 import granularity as groups
from megatronish.fp8 import kernels
from megatronish.fp8.parts import Parts
from megatronish.fp8.recipes import Operand
from megatronish.fp8.scaling import amax_to_scale, cast_to_fp8, dequantize

Axis = Literal["tp", "cp"]
Axes = frozenset  # of Axis: the dimensions of parallelism one dim of an operand is split over
WHOLE: Axes = frozenset()


@dataclass(frozen=True)
class TokenGroups:
    """The groups a layer's tokens are split over: `cp`, the cp group (None: whole tokens),
    and `tp_cp`, the tp x cp group (None unless tp > 1 too)."""

    cp: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class Split:
    """A linear layer's groups: its tp `group` and the dim of its weight split over it (`dim`,
    None: whole), the groups its tokens are split over, and the logical matrices of its output
    rows (`parts`, megatronish.fp8.parts; None: one)."""

    group: dist.ProcessGroup | None = None
    dim: Literal["out", "in"] | None = None
    tokens: TokenGroups = TokenGroups()
    parts: Parts | None = None

    def tp(self, dim: Literal["out", "in"]) -> Axes:
        """The axes of the weight's dim `dim`: tp where it is the split one."""
        return frozenset({"tp"}) if self.dim == dim else WHOLE

    @property
    def cp(self) -> Axes:
        """The axes of the token dim: cp where the tokens are split."""
        return frozenset({"cp"}) if self.tokens.cp is not None else WHOLE

    def of_many(self, axes: Axes) -> Axes:
        """Those of `axes` whose group has more than one rank."""
        tp = "tp" in axes and comm.group_size(self.group) > 1
        cp = "cp" in axes and self.tokens.cp is not None and comm.group_size(self.tokens.cp) > 1
        return frozenset({"tp"} if tp else ()) | frozenset({"cp"} if cp else ())

    def group_over(self, axes: Axes) -> dist.ProcessGroup | None:
        """The group of the ranks that split along `axes` (of_many's, not empty): tp's, cp's
        or tp x cp's (None: the default group, for a layer built without one)."""
        if axes == {"tp", "cp"}:
            return self.tokens.tp_cp
        return self.group if axes == {"tp"} else self.tokens.cp


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
    """One operand to cast: x [rows, K] as `operand`. rows, k: the axes (Split.tp, Split.cp)
    that dimension of x is split over (the whole tensor spans those ranks). `scale`: one already
    known (a tensorwise scale computed for an earlier GEMM of the same tensor)."""

    x: torch.Tensor
    operand: Operand
    rows: Axes = WHOLE
    k: Axes = WHOLE
    scale: torch.Tensor | None = None

    @property
    def spans(self) -> Axes:
        """The axes a scaling group of x spans (none for tiles and blocks: a shard holds whole
        ones, see config.derive)."""
        if self.scale is not None:
            return WHOLE
        granularity = self.operand.granularity
        if granularity == "tensor":
            return self.rows | self.k
        return self.k if granularity == "row" else WHOLE


def quantize(
    casts: list[Cast], power_of_2: bool, split: Split, backend: str = "auto"
) -> list[Quantized]:
    """Each cast's operand in fp8. The amaxes of the casts whose scaling groups span ranks go
    through one MAX all-reduce over the group of all the axes they span (none when no cast
    needs it, or that group has one rank). Where `backend` (kernels.backend) runs the fp8
    kernels (megatronish.fp8.kernels) the casts are fused, with the same results: from the
    reduced amaxes where there was a reduction, else each from its own operand's."""
    # An empty operand (an expert's run of no rows) is cast by the emulation: zero amaxes.
    fused = [kernels.fused(backend, cast.x) and cast.x.numel() > 0 for cast in casts]
    spans = [split.of_many(cast.spans) for cast in casts]
    amaxes = [
        None
        if cast.scale is not None or (on_kernels and not axes)
        else (kernels.amax if on_kernels else groups.amax)(cast.x, cast.operand.granularity)
        for cast, axes, on_kernels in zip(casts, spans, fused)
    ]
    reduced = [i for i, axes in enumerate(spans) if axes]
    if reduced:
        group = split.group_over(frozenset().union(*spans))
        flat = torch.cat([amaxes[i].to(torch.float32).reshape(-1) for i in reduced])
        comm.all_reduce(flat, group, op=dist.ReduceOp.MAX)
        for i, part in zip(reduced, flat.split([amaxes[i].numel() for i in reduced])):
            amaxes[i] = part.view(amaxes[i].shape)
    out = []
    for cast, amax, on_kernels in zip(casts, amaxes, fused):
        operand = cast.operand
        if on_kernels:
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
