"""Autograd communication ops over a tensor-parallel group (Megatron's f and g operators).

Shapes: b batch, s sequence, h hidden; t the tp group size. Activations are [b, s, h]; the
sequence-parallel ops split and gather dim 1. Each op is the identity when the group has one
rank, and every collective goes through megatronish.distributed.comm (which counts its bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatronish.distributed import comm

Group = dist.ProcessGroup | None


def split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's contiguous block of the last dim of x."""
    size = comm.group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=-1)[comm.group_rank(group)].contiguous()


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[..., n] on each rank -> [..., t * n], blocks in rank order."""
    size = comm.group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size,) + x.shape, dtype=x.dtype, device=x.device)
    comm.all_gather_into(out.view(-1), x.view(-1), group)
    return torch.cat(out.unbind(0), dim=-1)


def split_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, s, h] -> [b, s / t, h], this rank's contiguous block of the sequence."""
    size = comm.group_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=1)[comm.group_rank(group)].contiguous()


def gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, s / t, h] on each rank -> [b, s, h]."""
    size = comm.group_size(group)
    if size == 1:
        return x
    local = x.transpose(0, 1).contiguous()  # [s/t, b, h]
    out = torch.empty((size * local.shape[0],) + local.shape[1:], dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, local, group)
    return out.transpose(0, 1)  # [b, s, h] (a view)


def reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, s, h] partial sums on each rank -> [b, s / t, h] of the summed tensor."""
    size = comm.group_size(group)
    if size == 1:
        return x
    full = x.transpose(0, 1).contiguous()  # [s, b, h]
    out = torch.empty((full.shape[0] // size,) + full.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, full, group)
    return out.transpose(0, 1)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of x over the group, a new contiguous tensor (x is left as it is)."""
    if comm.group_size(group) == 1:
        return x
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    comm.all_reduce_into(out, x.contiguous(), group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group).contiguous(), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group).contiguous(), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group).contiguous(), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return x if comm.group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if comm.group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's block of the last dim forward; all-gather it backward."""
    return x if comm.group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-gather the last dim forward; keep this rank's block of the gradient backward."""
    return x if comm.group_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[b, s, h] -> [b, s/t, h] (no communication) forward; all-gather backward."""
    return x if comm.group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """[b, s/t, h] -> [b, s, h] all-gather forward; reduce-scatter backward."""
    return x if comm.group_size(group) == 1 else _GatherFromSequence.apply(x, group)


def to_tensor_parallel_region(
    x: torch.Tensor, group: Group, sequence_parallel: bool
) -> torch.Tensor:
    """Replicated activations [b, s(/t), ...] into the tensor-parallel region: all-gathered
    along the sequence under sequence parallelism (reduce-scattered backward), else copied
    (backward sums over the group)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_parallel_region(x, group)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: Group = None
) -> torch.Tensor:
    """[b, s, h] partial sums -> [b, s/t, h] reduce-scatter forward; all-gather backward."""
    return x if comm.group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)
