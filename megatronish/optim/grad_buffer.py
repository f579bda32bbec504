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

With ZeRO-1 (shard) each bucket is padded to a multiple of its group's size and reduce-scattered
instead: rank r gets the reduced block r, the optimizer updates the parameters' parts in that
block (the parameters live in one flat buffer laid out like the gradients), and the buckets'
parameters are all-gathered back, after the step in the order the next forward uses them,
each module's forward pre-hook waiting only for its own buckets.
"""

from __future__ import annotations

import torch
from torch import nn

from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.moe import is_expert


def buffered(param: nn.Parameter) -> bool:
    """Whether param's gradient goes through the buffer (not a parameter summed elsewhere
    first)."""
    return not (
        getattr(param, "sequence_parallel_grad", False) or getattr(param, "pipeline_tied", False)
    )


class _Bucket:
    def __init__(self, start: int, stop: int, params: list[nn.Parameter], group, size: int):
        self.start, self.stop, self.params, self.group, self.size = start, stop, params, group, size
        self.view: torch.Tensor  # the bucket's gradients (set once the buffer exists)
        self.pieces: list[Piece] = []  # ZeRO-1: the parts of params in this rank's block
        self.gather = None  # ZeRO-1: the parameter all-gather in flight
        self.pending = 0  # parameters still to produce their last micro-batch's gradient
        self.work = None


class Piece:
    """The part of a parameter that lies in this rank's shard of a bucket (ZeRO-1): 1-D views
    of the parameter (`data`, which carries the gradient part as `.grad`, so AdamW updates it
    as it updates a whole parameter), and where it lies in the flattened parameter."""

    def __init__(
        self, param: nn.Parameter, data: torch.Tensor, grad: torch.Tensor, lo: int, at: int
    ):
        self.param, self.data, self.lo, self.at = param, data, lo, at  # at: in the buffer
        self.data.grad = grad

    @property
    def grad(self) -> torch.Tensor:
        return self.data.grad


class GradBuffer:
    """The buffered parameters' gradients of this rank, in buckets of about bucket_bytes.
    start_step(micro_batches) before a step's first backward; finish() after its last.

    With shard (ZeRO-1) each bucket is padded to a multiple of its group's size n and rank r
    owns block r of it: the reduction is a reduce-scatter, only that block is scaled, and the
    parameters become views of one flat buffer laid out like the gradients, so that after the
    optimizer updates its blocks (`pieces`) gather_params() all-gathers every bucket in place.
    The buffered parameters' .grad stays None: their reduced gradient is only in the pieces."""

    def __init__(
        self,
        params: list[nn.Parameter],
        ps: ParallelState,
        bucket_bytes: int,
        overlap: bool,
        shard: bool = False,
    ):
        self.ps, self.overlap, self.shard = ps, overlap, shard
        self.bucket_bytes = bucket_bytes
        members = [p for p in reversed(params) if buffered(p)]
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[nn.Parameter, _Bucket] = {}
        self.calls: dict[nn.Parameter, int] = {}
        offsets: dict[nn.Parameter, int] = {}
        start = offset = 0
        current: list[nn.Parameter] = []
        for index, param in enumerate(members):
            offsets[param] = offset
            offset += param.numel()
            current.append(param)
            last = index == len(members) - 1
            if (
                last
                or (offset - start) * 4 >= bucket_bytes
                or (is_expert(members[index + 1]) != is_expert(param))
            ):
                bucket = self._add_bucket(start, offset, current)
                if shard:  # pad to a multiple of the group size: equal blocks
                    offset += -(offset - start) % bucket.size
                    bucket.stop = offset
                start, current = offset, []
        device = members[0].device if members else ps.device
        self.buffer = torch.zeros(offset, dtype=torch.float32, device=device)
        for bucket in self.buckets:
            bucket.view = self.buffer[bucket.start : bucket.stop]
        for param in members:
            param.main_grad = self.buffer[offsets[param] : offsets[param] + param.numel()]
            param.main_grad = param.main_grad.view_as(param)
        self.pieces: list[Piece] = []
        self.gather_order: list[_Bucket] | None = None  # set by overlap_param_gather
        if shard:
            self._shard_params(members, offsets)
        self.micro_batches = 0
        self.active = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in members]

    def _shard_params(self, members: list[nn.Parameter], offsets: dict[nn.Parameter, int]) -> None:
        """Moves the parameters into one flat buffer laid out like the gradients and lists the
        pieces of this rank's blocks."""
        dtypes = {p.dtype for p in members}
        assert len(dtypes) <= 1, f"ZeRO-1 buffers parameters of one dtype, not {dtypes}"
        self.params = torch.zeros_like(self.buffer, dtype=dtypes.pop() if dtypes else None)
        for param in members:
            flat = self.params[offsets[param] : offsets[param] + param.numel()]
            flat.copy_(param.data.reshape(-1))
            param.data = flat.view_as(param)
        for bucket in self.buckets:
            bucket.params_view = self.params[bucket.start : bucket.stop]
            block = (bucket.stop - bucket.start) // bucket.size
            lo = bucket.start + self.group_rank(bucket) * block
            hi = lo + block
            for param in bucket.params:
                a, b = max(lo, offsets[param]), min(hi, offsets[param] + param.numel())
                if a < b:
                    piece = Piece(param, self.params[a:b], self.buffer[a:b], a - offsets[param], a)
                    self.pieces.append(piece)
                    bucket.pieces.append(piece)
            bucket.block, bucket.block_lo = self.buffer[lo:hi], lo
        self.offsets = offsets

    def group_rank(self, bucket: _Bucket) -> int:
        """This rank's index in bucket's group."""
        return self.ps.edp_rank if is_expert(bucket.params[0]) else self.ps.dp_cp_rank

    def holds(self, param: nn.Parameter) -> bool:
        """Whether param's gradient is reduced here (the others: optim.reduce_gradients)."""
        return param in self.bucket_of

    def close(self) -> None:
        """Removes the hooks; the parameters' gradients are autograd's own again."""
        for hook in self._hooks:
            hook.remove()
        for param in self.bucket_of:
            del param.main_grad
        self.bucket_of, self.buckets, self._hooks, self.pieces = {}, [], [], []

    def _add_bucket(self, start: int, stop: int, params: list[nn.Parameter]) -> _Bucket:
        ps = self.ps
        group, size = (ps.edp_group, ps.edp) if is_expert(params[0]) else (ps.dp_cp_group, ps.dp_cp)
        bucket = _Bucket(start, stop, params, group, size)
        self.buckets.append(bucket)
        for param in params:
            self.bucket_of[param] = bucket
        return bucket

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
        if bucket.size == 1:
            return
        reduce = comm.reduce_scatter_in_place if self.shard else comm.all_reduce
        bucket.work = reduce(bucket.view, bucket.group, async_op=True)

    def finish(self) -> None:
        """Starts the buckets not started yet (in order), waits for each and divides it (under
        ZeRO-1 this rank's block of it) by dp x cp; without ZeRO-1 sets every buffered
        parameter's .grad to its main_grad."""
        self.active = False
        self.wait_params()  # a parameter no forward used
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        scale = 1.0 / self.ps.dp_cp
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if self.ps.dp_cp > 1:
                (bucket.block if self.shard else bucket.view).mul_(scale)
            if not self.shard:
                for param in bucket.params:
                    param.grad = param.main_grad

    def overlap_param_gather(self, uses: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """ZeRO-1: gather_params() starts the buckets' all-gathers asynchronously, in the
        order the forward needs them (uses: (module, parameters it needs), in forward order:
        model.forward_param_uses), and a forward pre-hook on each module waits for its
        parameters' buckets, so the gathers overlap the next forward."""
        need: dict[int, int] = {}  # bucket index -> first use
        index_of = {id(b): i for i, b in enumerate(self.buckets)}
        for use, (module, params) in enumerate(uses):
            held = {id(self.bucket_of[p]): self.bucket_of[p] for p in params if self.holds(p)}
            buckets = list(held.values())
            for bucket in buckets:
                need.setdefault(index_of[id(bucket)], use)
            if buckets:
                hook = module.register_forward_pre_hook(lambda *_, b=buckets: self.wait_params(b))
                self._hooks.append(hook)
        # a bucket no module claims goes first (read before any module runs)
        self.gather_order = sorted(self.buckets, key=lambda b: need.get(index_of[id(b)], -1))

    def gather_params(self) -> None:
        """ZeRO-1, after the optimizer updated this rank's blocks: every bucket's parameters
        all-gathered over its group, in place (started only, with overlap_param_gather)."""
        order = self.gather_order
        for bucket in order or self.buckets:
            bucket.gather = comm.all_gather_in_place(
                bucket.params_view, bucket.group, async_op=order is not None
            )

    def wait_params(self, buckets: list[_Bucket] | None = None) -> None:
        """Waits for the parameter all-gathers of buckets (default: all) still in flight."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None

    def gather_block(self, bucket: _Bucket, block: torch.Tensor) -> torch.Tensor:
        """ZeRO-1: a bucket-sized tensor whose block r is rank r's `block` (e.g. an optimizer
        state laid out like bucket's block), gathered over bucket's group."""
        full = torch.zeros_like(bucket.view)
        full.view(bucket.size, -1)[self.group_rank(bucket)].copy_(block)
        comm.all_gather_in_place(full, bucket.group)
        return full

    def zero(self) -> None:
        """Clears the buffer (and the buffered parameters' .grad) for the next step."""
        self.buffer.zero_()
        for param in self.bucket_of:
            param.grad = None
