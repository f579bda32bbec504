"""The parameters outside the buckets: sequence-parallel replicated parameters, the pipeline
copies of tied embeddings (every parameter when the buckets are off, the reference the bucketed
reductions are held to) and, under ZeRO, those the optimizer needs whole (Muon's). Their
gradients are reduced after backward, in flat buckets all-reduced; under ZeRO each one's
optimizer state lives whole on one rank of its group (its owner), which broadcasts the updated
parameter after the step, and the gradients of those the optimizer needs whole are reduced to
their owner alone (half an all-reduce's bytes; no other rank keeps them).

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
    owners: dict[int, int] | None = None,
) -> None:
    """Sums the gradients of sequence-parallel replicated parameters over the tp group and
    those of the two copies of tied embeddings over the first and last pipeline stage, then
    averages every gradient over the dp x cp group (the data-parallel group when cp is 1) in
    flat buckets of about bucket_bytes (optim.bucket_mb); expert gradients are summed over
    their expert-data-parallel group and divided by dp x cp. The dp x cp and expert averages
    travel in dtype (optim.grad_reduce_dtype: buckets.on_the_wire); the tp and embedding sums
    in fp32. A parameter in `owners` (id -> its owner's global rank: ZeRO's whole parameters
    the optimizer needs whole) is reduced to its owner alone, in buckets per owner, and the
    other ranks drop its gradient once it is sent."""
    if ps.embedding_group is not None:
        for p in params:
            if role(p).pipeline_tied and p.grad is not None:
                comm.all_reduce(p.grad, ps.embedding_group)
    if ps.tp > 1:
        tagged = [p for p in params if role(p).sequence_parallel_grad and p.grad is not None]
        _finish(_launch_buckets([p.grad for p in tagged], ps.tp_group, 1.0, bucket_bytes), 1.0)
    if ps.dp_cp == 1:
        return
    scale, owners = 1.0 / ps.dp_cp, owners or {}
    with_grad = [p for p in params if p.grad is not None]
    for experts, size, group in ((False, ps.dp_cp, ps.dp_cp_group), (True, ps.edp, ps.edp_group)):
        members = [p for p in with_grad if role(p).is_expert == experts]
        if size == 1:
            if members:
                torch._foreach_mul_([p.grad for p in members], scale)
            continue
        shared = [p.grad for p in members if id(p) not in owners]
        handles = _launch_buckets(shared, group, scale, bucket_bytes, dtype)
        for dst in sorted({owners[id(p)] for p in members if id(p) in owners}):
            grads = [p.grad for p in members if owners.get(id(p)) == dst]
            handles += _launch_buckets(grads, group, scale, bucket_bytes, dtype, dst)
        _finish(handles, scale, ps.rank)
        for p in members:
            if owners.get(id(p), ps.rank) != ps.rank:
                p.grad = None


def _launch_buckets(
    grads: list[torch.Tensor],
    group,
    scale: float,
    bucket_bytes: int,
    dtype: torch.dtype = torch.float32,
    dst: int | None = None,
) -> list[tuple]:
    """Starts the sums over group (dst None: all-reduces; else reduces to global rank dst) of
    grads in flat buckets of about bucket_bytes, sent in dtype (on_the_wire: scaled before the
    sum when that is not their own); ``_finish`` waits for them."""
    handles, bucket, size = [], [], 0
    for grad in grads:
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes:
            handles.append(_launch(bucket, group, scale, dtype, dst))
            bucket, size = [], 0
    if bucket:
        handles.append(_launch(bucket, group, scale, dtype, dst))
    return handles


def _launch(bucket: list[torch.Tensor], group, scale: float, dtype: torch.dtype, dst: int | None):
    flat = on_the_wire(torch.cat([g.reshape(-1) for g in bucket]), scale, dtype)
    if dst is None:
        return comm.all_reduce(flat, group, async_op=True), flat, bucket, dst
    return comm.reduce(flat, dst, group, async_op=True), flat, bucket, dst


def _finish(handles: list[tuple], scale: float, rank: int | None = None) -> None:
    """Waits for each bucket's sum and copies it, times scale, back into its gradients where
    this rank (global `rank`) received it: every all-reduce, the reduces to it."""
    for work, flat, members, dst in handles:
        work.wait()
        if dst is not None and dst != rank:
            continue
        if scale != 1.0 and flat.dtype == members[0].dtype:
            flat.mul_(scale)
        offset = 0
        for grad in members:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


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
    after the step the owner broadcasts it over the group. The gradients of those in
    `to_owner` (ids) are reduced to their owner alone (`reduced_to`: id -> the owner's global
    rank, for reduce_gradients)."""

    def __init__(
        self, params: list[nn.Parameter], ps: ParallelState, to_owner: frozenset[int] = frozenset()
    ):
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
        self.reduced_to = {id(p): rank for p, rank, _ in self.owners if id(p) in to_owner}
        owned_ids = {id(p) for p in owned}
        self.owned = [p for p in params if id(p) in owned_ids]  # in the parameters' order

    def broadcast(self) -> None:
        """Every owner's updated parameters to the other ranks of their groups."""
        for param, owner, group in self.owners:
            comm.broadcast(param.data, owner, group)
