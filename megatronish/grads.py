"""Gradient reduction overlapped with backward: one contiguous fp32 buffer of gradients
(Megatron's main_grad), split into buckets in the reverse order of the parameters (the order
backward produces their gradients), each all-reduced over the dp x cp group as soon as the
last micro-batch of the step has produced every gradient in it.

Each parameter's gradient lives in a view of the buffer, `param.main_grad`. A hook after
autograd accumulates a micro-batch's gradient into param.grad adds it to main_grad and drops
param.grad, so micro-batches accumulate into the buffer in the order autograd would have
accumulated them. When a bucket's parameters have all had their last micro-batch's gradient,
its all-reduce starts asynchronously (optim.overlap_grad_reduce; otherwise every bucket goes
after backward); finish() waits for each bucket, scales it by 1 / (dp x cp) and points
param.grad at main_grad for clipping and the optimizer. Expert weights (MoE, split over ep)
are summed over their expert-data-parallel group instead (the ranks that hold the same
experts; the all-to-all backward already summed the other ep ranks' tokens into them), with
the same 1 / (dp x cp): a bucket holds parameters of one group only. Buckets are views: no
concatenation or copy on the step's path.

Parameters whose gradient must first be summed over another group keep their own .grad and
the path of optim.reduce_gradients: sequence-parallel replicated parameters (summed over tp
first) and the two copies of tied embeddings on the first and last pipeline stage (summed over
the embedding group first). The sums are those of reduce_gradients, element for element, so
the losses are bitwise the same as without the buffer (shared-memory and two-rank gloo sums
are in rank order whatever the bucket boundaries).
"""

from __future__ import annotations

import torch
from torch import nn

from megatronish import comm
from megatronish.moe import is_expert
from megatronish.parallel import ParallelState


def buffered(param: nn.Parameter) -> bool:
    """Whether param's gradient goes through the buffer (not a parameter summed elsewhere
    first)."""
    return not (
        getattr(param, "sequence_parallel_grad", False) or getattr(param, "pipeline_tied", False)
    )


class _Bucket:
    def __init__(self, view: torch.Tensor, params: list[nn.Parameter], group, size: int):
        self.view, self.params, self.group, self.size = view, params, group, size
        self.pending = 0  # parameters still to produce their last micro-batch's gradient
        self.work = None


class GradBuffer:
    """The buffered parameters' gradients of this rank, in buckets of about bucket_bytes.
    start_step(micro_batches) before a step's first backward; finish() after its last."""

    def __init__(
        self, params: list[nn.Parameter], ps: ParallelState, bucket_bytes: int, overlap: bool
    ):
        self.ps, self.overlap = ps, overlap
        members = [p for p in reversed(params) if buffered(p)]
        total = sum(p.numel() for p in members)
        device = members[0].device if members else ps.device
        self.buffer = torch.zeros(total, dtype=torch.float32, device=device)
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[nn.Parameter, _Bucket] = {}
        self.calls: dict[nn.Parameter, int] = {}
        start = offset = 0
        current: list[nn.Parameter] = []
        for index, param in enumerate(members):
            param.main_grad = self.buffer[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            current.append(param)
            last = index == len(members) - 1
            if (
                last
                or (offset - start) * 4 >= bucket_bytes
                or (is_expert(members[index + 1]) != is_expert(param))
            ):
                self._add_bucket(start, offset, current)
                start, current = offset, []
        self.micro_batches = 0
        self.active = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in members]

    def holds(self, param: nn.Parameter) -> bool:
        """Whether param's gradient is reduced here (the others: optim.reduce_gradients)."""
        return param in self.bucket_of

    def close(self) -> None:
        """Removes the hooks; the parameters' gradients are autograd's own again."""
        for hook in self._hooks:
            hook.remove()
        for param in self.bucket_of:
            del param.main_grad
        self.bucket_of, self.buckets, self._hooks = {}, [], []

    def _add_bucket(self, start: int, stop: int, params: list[nn.Parameter]) -> None:
        ps = self.ps
        group, size = (ps.edp_group, ps.edp) if is_expert(params[0]) else (ps.dp_cp_group, ps.dp_cp)
        bucket = _Bucket(self.buffer[start:stop], params, group, size)
        self.buckets.append(bucket)
        for param in params:
            self.bucket_of[param] = bucket

    def start_step(self, micro_batches: int) -> None:
        """Arms the hooks for a step of micro_batches backward passes."""
        self.micro_batches, self.active = micro_batches, True
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.params), None
        self.calls = dict.fromkeys(self.bucket_of, 0)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.active:
            return
        param.main_grad.add_(param.grad)
        param.grad = None
        self.calls[param] += 1
        if self.calls[param] == self.micro_batches:
            bucket = self.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0 and self.overlap:
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.size > 1:
            bucket.work = comm.all_reduce(bucket.view, bucket.group, async_op=True)

    def finish(self) -> None:
        """Starts the buckets not started yet (in order), waits for each, divides it by dp x cp
        and sets every buffered parameter's .grad to its main_grad."""
        self.active = False
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        scale = 1.0 / self.ps.dp_cp
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if self.ps.dp_cp > 1:
                bucket.view.mul_(scale)
            for param in bucket.params:
                param.grad = param.main_grad

    def zero(self) -> None:
        """Clears the buffer (and the buffered parameters' .grad) for the next step."""
        self.buffer.zero_()
        for param in self.bucket_of:
            param.grad = None
