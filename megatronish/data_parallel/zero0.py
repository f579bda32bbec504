"""ZeRO-0: plain data parallelism over the buckets, nothing sharded."""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from megatronish.data_parallel.base import DataParallel, Uses
from megatronish.data_parallel.buckets import Bucket
from megatronish.distributed import comm
from megatronish.optim import IN_FLIGHT


class Zero0(DataParallel):
    """Every rank keeps whole parameters, gradients and optimizer state. The buckets' gradients live
    in one contiguous fp32 buffer (Megatron's main_grad), each parameter's in a view of it: the
    hook after autograd accumulates a micro-batch's gradient into param.grad adds it there and
    drops param.grad, so micro-batches accumulate in the order autograd would have. When a
    bucket's parameters have all had their last micro-batch's gradient, its reduction starts
    asynchronously (optim.overlap_grad_reduce; otherwise every bucket's starts after backward);
    after_backward waits for each, divides what this rank keeps of it by dp x cp and points
    each parameter's .grad at its view. Buckets are views: no copy on the step's path, but for
    a bf16 reduction (optim.grad_reduce_dtype), which sends a divided bf16 copy of each bucket
    (`bucket.sent`, at most optim.IN_FLIGHT of them at once) and copies its sum back into the
    view.

    Collectives per step: one all-reduce of each bucket over its group (none at a group of one).
    """

    def _lay_out(self, uses: Uses) -> None:
        self._lay_out_grads()

    def _lay_out_grads(self) -> None:
        """The whole gradient buffer; each bucket's view of it is also what this rank keeps."""
        layout = self.layout
        self.sending: deque[Bucket] = deque()  # buckets whose bf16 copy is in flight
        self.grad_buffer = torch.zeros(layout.size, dtype=torch.float32, device=layout.device)
        for bucket in self.buckets:
            bucket.view = bucket.grad_shard = self.grad_buffer[bucket.start : bucket.stop]
        self.main_grad = {p: layout.flat_view(self.grad_buffer, p) for p in layout.members}

    def _take_grad(self, param: nn.Parameter) -> None:
        self.main_grad[param].add_(param.grad)
        param.grad = None
        self.calls[param] += 1
        if self.calls[param] == self.micro_batches:
            bucket = self.layout.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0 and self.overlap:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        """Starts bucket's reduction; a bf16 one's copy is received (_receive) once
        optim.IN_FLIGHT later ones are in flight, so that at most that many copies exist."""
        if bucket.size > 1:
            bucket.sent = self._sent(bucket, bucket.view)
            bucket.work = self._reduce(bucket)
            if self._divided_before(bucket):
                self.sending.append(bucket)
                while len(self.sending) > IN_FLIGHT:
                    self._receive(self.sending.popleft())

    def _receive(self, bucket: Bucket) -> None:
        """Waits for bucket's bf16 reduction and copies what this rank keeps of the sum into
        its fp32 gradients (bucket.grad_shard)."""
        bucket.work.wait()
        bucket.grad_shard.copy_(self._kept(bucket, bucket.sent))
        bucket.sent = None

    def _reduce(self, bucket: Bucket):
        """Starts the reduction of bucket.sent over its group (returns the work)."""
        return comm.all_reduce(bucket.sent, bucket.group, async_op=True)

    def _finish_buckets(self) -> None:
        self._reduce_all()
        for param in self.layout.members:
            param.grad = self.main_grad[param]

    def _reduce_all(self) -> None:
        """Starts the buckets not started yet (in order), waits for each and divides what this
        rank keeps of it (bucket.grad_shard) by dp x cp, or with a bf16 reduction copies it
        there from the bf16 sum of the divided gradients."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        scale = 1.0 / self.ps.dp_cp
        while self.sending:
            self._receive(self.sending.popleft())
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if self.ps.dp_cp > 1 and not self._divided_before(bucket):
                bucket.grad_shard.mul_(scale)
            bucket.sent = None

    def _clear_grads(self) -> None:
        self.grad_buffer.zero_()
