"""Gradient clipping by the global norm, each parameter counted once: the squares of tp-split
gradients are summed over the tp group (experts' over the ep group first: each ep rank holds
other experts), replicated ones are taken once, and the stages' sums are added over the
pipeline. Which gradients a rank counts (whole ones, or its shards of sharded ones, summed over
their groups first) is data parallelism's to say (megatronish.data_parallel)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.layers.roles import role


@dataclass
class Squares:
    """fp64 sums of squared gradient elements (scalars) of the parameters split over tp, of the
    replicated ones and of the experts'."""

    split: torch.Tensor
    replicated: torch.Tensor
    expert: torch.Tensor


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared elements of grads, as an fp64 scalar (per-tensor norms first)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()


def squares(
    grads: list[tuple[nn.Parameter, torch.Tensor]], device: torch.device, tp: int = 1
) -> Squares:
    """The Squares of grads ((parameter, its gradient or a part of it) pairs). An expert
    tensor replicated over the tp group's tp ranks (a LoRA adapter's: moe.adapters) counts
    1 / tp on each, as the experts' squares are summed over tp."""
    experts = [(p, g) for p, g in grads if role(p).is_expert]
    dense = [(p, g) for p, g in grads if not role(p).is_expert]
    split = [g for p, g in dense if role(p).tp_split_dim is not None]
    replicated = [g for p, g in dense if role(p).tp_split_dim is None]
    expert_split = [g for p, g in experts if role(p).tp_split_dim is not None]
    expert_whole = [g for p, g in experts if role(p).tp_split_dim is None]
    expert = _sum_of_squares(expert_split, device) + _sum_of_squares(expert_whole, device) / tp
    return Squares(_sum_of_squares(split, device), _sum_of_squares(replicated, device), expert)


def global_norm(local: Squares, ps: ParallelState) -> float:
    """The global gradient norm from this rank's Squares (each gradient element counted on one
    rank of the dp x cp group): summed over the ep, tp and pipeline groups."""
    expert = local.expert
    if ps.ep > 1:
        comm.all_reduce(expert, ps.ep_group, op=dist.ReduceOp.SUM)
    split = local.split + expert
    if ps.tp > 1:
        comm.all_reduce(split, ps.tp_group, op=dist.ReduceOp.SUM)
    total = split + local.replicated
    if ps.pp > 1:
        comm.all_reduce(total, ps.pp_group, op=dist.ReduceOp.SUM)
    return float(total.sqrt())


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scales grads down so that their global norm `norm` becomes max_norm, when it exceeds it
    (max_norm 0: no clipping)."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
