"""ZeRO-2: gradients sharded as well as optimizer state."""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.zero1 import Zero1
from megatronish.distributed import comm
from megatronish.optim import IN_FLIGHT


class Zero2(Zero1):
    """ZeRO-1 without the whole gradient buffer: of each bucket's gradients only this rank's
    shard is kept between steps (`grad_shards`). A bucket's gradients accumulate in a
    bucket-sized tensor made when its first gradient of a micro-batch arrives; when every
    parameter of the bucket has given it one more, it is reduce-scattered (started at once with
    the overlap) and, once done, this rank's shard of it is added into the kept shard and the
    tensor dropped: one reduce-scatter per bucket per micro-batch (Megatron-FSDP's choice of
    reducing every micro-batch, not keeping whole gradients until the last), with at most
    optim.IN_FLIGHT of them outstanding. At one micro-batch a step this is ZeRO-1's reduction,
    bit for bit.

    Collectives per step: a reduce-scatter per bucket per micro-batch; the parameters'
    all-gathers, the owners' broadcasts and the norm's all-reduces as ZeRO-1."""

    def _lay_out_grads(self) -> None:
        sizes = [bucket.shard_size for bucket in self.buckets]
        device = self.layout.device
        self.grad_shards = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        at = 0
        for bucket, size in zip(self.buckets, sizes):
            bucket.grad_shard = self.grad_shards[at : at + size]
            at += size
        self.in_flight: deque = deque()  # (bucket, its gradients, the reduce-scatter's work)

    def _take_grad(self, param: nn.Parameter) -> None:
        """param's gradient into its bucket's micro-batch gradients; the bucket is
        reduce-scattered once each of its parameters has given it one more."""
        bucket = self.layout.bucket_of[param]
        if bucket.view is None:
            size = bucket.stop - bucket.start
            bucket.view = torch.zeros(size, dtype=torch.float32, device=self.layout.device)
        at = self.layout.offsets[param] - bucket.start
        bucket.view[at : at + param.numel()].view_as(param).add_(param.grad)
        param.grad = None
        bucket.arrived += 1
        if bucket.arrived % len(bucket.params) == 0:
            self._reduce_scatter(bucket)

    def _reduce_scatter(self, bucket: Bucket) -> None:
        """Starts the reduce-scatter of bucket's gradients (synchronous without the overlap),
        whose shard _add_shard adds to the kept one."""
        grads, bucket.view = self._sent(bucket, bucket.view), None
        work = comm.reduce_scatter_in_place(grads, bucket.group, async_op=self.overlap)
        self.in_flight.append((bucket, grads, work))
        while len(self.in_flight) > (IN_FLIGHT if self.overlap else 0):
            self._add_shard(*self.in_flight.popleft())

    def _add_shard(self, bucket: Bucket, grads: torch.Tensor, work) -> None:
        if work is not None:
            work.wait()
        bucket.grad_shard.add_(self._kept(bucket, grads))

    def _finish_buckets(self) -> None:
        """The last reduce-scatters (of buckets some parameter of which gave no gradient)
        started, every shard added and divided by dp x cp (unless a bf16 reduction divided its
        parts before)."""
        self._wait_params()  # a parameter no forward used
        for bucket in self.buckets:
            if bucket.view is not None:
                self._reduce_scatter(bucket)
        while self.in_flight:
            self._add_shard(*self.in_flight.popleft())
        after = [b.grad_shard for b in self.buckets if not self._divided_before(b)]
        if self.ps.dp_cp > 1 and after:
            torch._foreach_mul_(after, 1.0 / self.ps.dp_cp)

    def _clear_grads(self) -> None:
        self.grad_shards.zero_()
