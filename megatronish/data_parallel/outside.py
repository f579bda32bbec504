"""The parameters outside the buckets: sequence-parallel replicated parameters, the pipeline
copies of tied embeddings (every parameter when the buckets are off, the reference the bucketed
reductions are held to). Their gradients are reduced after backward, in flat buckets
all-reduced; under ZeRO each one's optimizer state lives whole on one rank of its group (its
owner), which broadcasts the updated parameter after the step.

The sums are those of the buckets, element for element (shared-memory and two-rank gloo sums
are in rank order whatever the bucket boundaries), so where a parameter is reduced changes no
bit of the losses.
"""

from __future__ import annotations

import torch
from torch import nn

from megatronish.config.schema import OptimConfig
from megatronish.data_parallel.buckets import on_the_wire
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.layers.roles import role

DEFAULT_BUCKET_BYTES = int(OptimConfig.bucket_mb * 2**20)


def reduce_gradients(
    params: list[nn.Parameter],
    ps: ParallelState,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Sums the gradients of sequence-parallel replicated parameters over the tp group and
    those of the two copies of tied embeddings over the first and last pipeline stage, then
    averages every gradient over the dp x cp group (the data-parallel group when cp is 1) in
    flat buckets of about bucket_bytes (optim.bucket_mb); expert gradients are summed over
    their expert-data-parallel group and divided by dp x cp. The dp x cp and expert averages
    travel in dtype (optim.grad_reduce_dtype: buckets.on_the_wire); the tp and embedding sums
    in fp32."""
    if ps.embedding_group is not None:
        for p in params:
            if role(p).pipeline_tied and p.grad is not None:
                comm.all_reduce(p.grad, ps.embedding_group)
    if ps.tp > 1:
        tagged = [p for p in params if role(p).sequence_parallel_grad and p.grad is not None]
        _bucketed_all_reduce([p.grad for p in tagged], ps.tp_group, 1.0, bucket_bytes)
    if ps.dp_cp > 1:
        scale = 1.0 / ps.dp_cp
        grads = [p.grad for p in params if p.grad is not None and not role(p).is_expert]
        _bucketed_all_reduce(grads, ps.dp_cp_group, scale, bucket_bytes, dtype)
        experts = [p.grad for p in params if p.grad is not None and role(p).is_expert]
        if ps.edp > 1:
            _bucketed_all_reduce(experts, ps.edp_group, scale, bucket_bytes, dtype)
        elif experts:
            torch._foreach_mul_(experts, 1.0 / ps.dp_cp)


def _bucketed_all_reduce(
    grads: list[torch.Tensor],
    group,
    scale: float,
    bucket_bytes: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """grads <- their sum over group times scale, in flat buckets of about bucket_bytes of
    grads sent in dtype (on_the_wire: scaled before the sum when that is not their own)."""
    bucket: list[torch.Tensor] = []
    size = 0
    handles = []
    for grad in grads:
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes:
            handles.append(_launch(bucket, group, scale, dtype))
            bucket, size = [], 0
    if bucket:
        handles.append(_launch(bucket, group, scale, dtype))
    for work, flat, members in handles:
        work.wait()
        if scale != 1.0 and flat.dtype == members[0].dtype:
            flat.mul_(scale)
        offset = 0
        for grad in members:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _launch(bucket: list[torch.Tensor], group, scale: float, dtype: torch.dtype):
    flat = on_the_wire(torch.cat([g.reshape(-1) for g in bucket]), scale, dtype)
    return comm.all_reduce(flat, group, async_op=True), flat, bucket


def zero_owners(params: list[nn.Parameter], size: int) -> list[int]:
    """The rank of a group of `size` that owns each parameter's optimizer state: greedy balancing
    of element counts, largest first, deterministic on every rank."""
    loads = [0] * size
    owners = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        owner = min(range(size), key=lambda d: (loads[d], d))
        owners[index] = owner
        loads[owner] += params[index].numel()
    return owners


class WholeOwners:
    """ZeRO for the parameters outside the buckets: each parameter owned whole by one rank of
    the dp x cp group (experts: of their expert-data-parallel group), balanced by zero_owners;
    after the step the owner broadcasts it over the group."""

    def __init__(self, params: list[nn.Parameter], ps: ParallelState):
        dense = [p for p in params if not role(p).is_expert]
        experts = [p for p in params if role(p).is_expert]
        # (param, the owner's global rank, the group to broadcast over)
        self.owners: list[tuple[nn.Parameter, int, object]] = []
        owned: list[nn.Parameter] = []
        for members, size, rank, global_rank, group in (
            (dense, ps.dp_cp, ps.dp_cp_rank, ps.dp_cp_global_rank, ps.dp_cp_group),
            (experts, ps.edp, ps.edp_rank, ps.edp_global_rank, ps.edp_group),
        ):
            for param, owner in zip(members, zero_owners(members, size)):
                self.owners.append((param, global_rank(owner), group))
                if owner == rank:
                    owned.append(param)
        owned_ids = {id(p) for p in owned}
        self.owned = [p for p in params if id(p) in owned_ids]  # in the parameters' order

    def broadcast(self) -> None:
        """Every owner's updated parameters to the other ranks of their groups."""
        for param, owner, group in self.owners:
            comm.broadcast(param.data, owner, group)
