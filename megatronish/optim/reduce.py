"""The plain gradient reduction, after backward, of the parameters the gradient buffer does not
hold (sequence-parallel replicated parameters, the pipeline copies of tied embeddings; every
parameter when a test asks for the unbuffered reference): flat buckets, all-reduced."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.config.schema import OptimConfig
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.moe import is_expert

DEFAULT_BUCKET_BYTES = int(OptimConfig.bucket_mb * 2**20)


def reduce_gradients(
    params: list[nn.Parameter], ps: ParallelState, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Sums the gradients of sequence-parallel replicated parameters over the tp group and
    those of the two copies of tied embeddings over the first and last pipeline stage, then
    averages every gradient over the dp x cp group (the data-parallel group when cp is 1) in
    flat buckets of about bucket_bytes (optim.bucket_mb); expert gradients are summed over
    their expert-data-parallel group and divided by dp x cp."""
    if ps.embedding_group is not None:
        for p in params:
            if getattr(p, "pipeline_tied", False) and p.grad is not None:
                comm.all_reduce(p.grad, ps.embedding_group)
    if ps.tp > 1:
        tagged = [
            p for p in params if getattr(p, "sequence_parallel_grad", False) and p.grad is not None
        ]
        _bucketed_all_reduce([p.grad for p in tagged], ps.tp_group, 1.0, bucket_bytes)
    if ps.dp_cp > 1:
        grads = [p.grad for p in params if p.grad is not None and not is_expert(p)]
        _bucketed_all_reduce(grads, ps.dp_cp_group, 1.0 / ps.dp_cp, bucket_bytes)
        experts = [p.grad for p in params if p.grad is not None and is_expert(p)]
        if ps.edp > 1:
            _bucketed_all_reduce(experts, ps.edp_group, 1.0 / ps.dp_cp, bucket_bytes)
        elif experts:
            torch._foreach_mul_(experts, 1.0 / ps.dp_cp)


def _bucketed_all_reduce(grads: list[torch.Tensor], group, scale: float, bucket_bytes: int) -> None:
    bucket: list[torch.Tensor] = []
    size = 0
    handles = []
    for grad in grads:
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes:
            handles.append(_launch(bucket, group))
            bucket, size = [], 0
    if bucket:
        handles.append(_launch(bucket, group))
    for work, flat, members in handles:
        work.wait()
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for grad in members:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _launch(bucket: list[torch.Tensor], group):
    flat = torch.cat([g.reshape(-1) for g in bucket])
    return comm.all_reduce(flat, group, async_op=True), flat, bucket
