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

With ZeRO-2 (zero = 2) only this rank's block of each bucket's gradients is kept between steps.
A bucket's gradients accumulate in a bucket-sized tensor made when its first gradient of a
micro-batch arrives; when every parameter of the bucket has given it one more gradient, it is
reduce-scattered (started, with the overlap) and, once done, this rank's block of it is added
into the kept block and the tensor dropped: one reduce-scatter per bucket per micro-batch
(Megatron-FSDP's choice of reducing every micro-batch, not keeping whole gradients until the
last), with at most IN_FLIGHT of them outstanding. ZeRO-3 (zero = 3) shards the parameters
too (optim.param_shards), with buckets that each hold the parameters of one module of the
forward, so that a module's gather is its own buckets'.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
from torch import nn

from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.moe import is_expert
from megatronish.optim import IN_FLIGHT
from megatronish.optim.buckets import Bucket, Piece, buffered
from megatronish.optim.param_shards import ParamShards


class GradBuffer:
    """The buffered parameters' gradients of this rank, in buckets of about bucket_bytes.
    start_step(micro_batches) before a step's first backward; finish() after its last.

    With shard (ZeRO-1) each bucket is padded to a multiple of its group's size n and rank r
    owns block r of it: the reduction is a reduce-scatter, only that block is scaled, and the
    parameters become views of one flat buffer laid out like the gradients, so that after the
    optimizer updates its blocks (`pieces`) gather_params() all-gathers every bucket in place.
    The buffered parameters' .grad stays None: their reduced gradient is only in the pieces.
    With zero = 2 the pieces' gradients are the only gradients kept (no whole buffer), and with
    zero = 3 their parameters the only parameters (`shards`). `uses` (model.forward_param_uses)
    places ZeRO-3's module hooks and bucket boundaries, and ZeRO-1 and 2's gathers with the
    overlap (overlap_param_gather); `prefetch`: optim.zero3_prefetch."""

    def __init__(
        self,
        params: list[nn.Parameter],
        ps: ParallelState,
        bucket_bytes: int,
        overlap: bool,
        zero: int = 0,
        uses: list[tuple[nn.Module, list[nn.Parameter]]] | None = None,
        prefetch: bool = True,
    ):
        self.ps, self.overlap, self.level, self.shard = ps, overlap, zero, zero >= 1
        self.bucket_bytes = bucket_bytes
        members = [p for p in reversed(params) if buffered(p)]
        use_of: dict[nn.Parameter, int] = {}  # ZeRO-3: a bucket holds one module's parameters
        for index, (_, used) in enumerate(uses if zero == 3 else []):
            for param in used:
                use_of.setdefault(param, index)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
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
                or use_of.get(members[index + 1]) != use_of.get(param)
            ):
                bucket = self._add_bucket(start, offset, current)
                if self.shard:  # pad to a multiple of the group size: equal blocks
                    offset += -(offset - start) % bucket.size
                    bucket.stop = offset
                start, current = offset, []
        self.device = members[0].device if members else ps.device
        if zero < 2:
            self.buffer = torch.zeros(offset, dtype=torch.float32, device=self.device)
            for bucket in self.buckets:
                bucket.view = self.buffer[bucket.start : bucket.stop]
            for param in members:
                param.main_grad = self.buffer[offsets[param] : offsets[param] + param.numel()]
                param.main_grad = param.main_grad.view_as(param)
        self.offsets, self.size = offsets, offset
        self.pieces: list[Piece] = []
        self.gather_order: list[Bucket] | None = None  # set by overlap_param_gather
        self.shards: ParamShards | None = None  # ZeRO-3
        self.in_flight: deque = deque()  # ZeRO-2 and 3: (bucket, its gradients, the work)
        if self.shard:
            self._shard_params(members, prefetch)
        self.micro_batches = 0
        self.active = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in members]
        if self.shards is not None:
            self.shards.register(self._bucket_uses(uses or []))
        elif self.shard and overlap and uses is not None:
            self.overlap_param_gather(uses)

    def _shard_params(self, members: list[nn.Parameter], prefetch: bool) -> None:
        """Moves the parameters into one flat buffer laid out like the gradients (ZeRO-3: into
        the shards) and lists the pieces of this rank's blocks."""
        offsets = self.offsets
        for bucket in self.buckets:
            bucket.rank = self.group_rank(bucket)
        if self.level == 3:
            keep = self.ps.pp > 1  # several micro-batches in flight: gathered for the step
            self.shards = ParamShards(
                self.buckets, offsets, self.overlap, prefetch, keep_for_step=keep
            )
        else:
            dtypes = {p.dtype for p in members}
            assert len(dtypes) <= 1, f"ZeRO buffers parameters of one dtype, not {dtypes}"
            dtype = dtypes.pop() if dtypes else None
            self.params = torch.zeros(self.size, dtype=dtype, device=self.device)
            for param in members:
                flat = self.params[offsets[param] : offsets[param] + param.numel()]
                flat.copy_(param.data.reshape(-1))
                param.data = flat.view_as(param)
        blocks = [(b.stop - b.start) // b.size for b in self.buckets]
        if self.level >= 2:
            self.grad_blocks = torch.zeros(sum(blocks), dtype=torch.float32, device=self.device)
        at = 0
        for bucket, block in zip(self.buckets, blocks):
            lo = bucket.start + bucket.rank * block
            hi = lo + block
            if self.level < 3:
                bucket.params_view = self.params[bucket.start : bucket.stop]
            if self.level < 2:
                bucket.block = self.buffer[lo:hi]
            else:
                bucket.block = self.grad_blocks[at : at + block]
            param_block = bucket.param_block if self.level == 3 else self.params[lo:hi]
            for param in bucket.params:
                a, b = max(lo, offsets[param]), min(hi, offsets[param] + param.numel())
                if a < b:
                    data, grad = param_block[a - lo : b - lo], bucket.block[a - lo : b - lo]
                    piece = Piece(param, data, grad, a - offsets[param], a)
                    self.pieces.append(piece)
                    bucket.pieces.append(piece)
            bucket.block_lo = lo
            at += block

    def _bucket_uses(self, uses) -> list[tuple[list[Bucket], nn.Module]]:
        """(the buckets of the parameters it needs, module) of each module of uses that needs
        buffered parameters, in forward order."""
        out = []
        for module, params in uses:
            held = {id(self.bucket_of[p]): self.bucket_of[p] for p in params if self.holds(p)}
            if held:
                out.append((list(held.values()), module))
        return out

    def group_rank(self, bucket: Bucket) -> int:
        """This rank's index in bucket's group."""
        return self.ps.edp_rank if is_expert(bucket.params[0]) else self.ps.dp_cp_rank

    def holds(self, param: nn.Parameter) -> bool:
        """Whether param's gradient is reduced here (the others: optim.reduce_gradients)."""
        return param in self.bucket_of

    def close(self) -> None:
        """Removes the hooks; the parameters' gradients are autograd's own again."""
        for hook in self._hooks:
            hook.remove()
        if self.shards is not None:
            self.shards.close()
        for param in self.bucket_of:
            if self.level < 2:
                del param.main_grad
        self.bucket_of, self.buckets, self._hooks, self.pieces = {}, [], [], []

    def _add_bucket(self, start: int, stop: int, params: list[nn.Parameter]) -> Bucket:
        ps = self.ps
        group, size = (ps.edp_group, ps.edp) if is_expert(params[0]) else (ps.dp_cp_group, ps.dp_cp)
        bucket = Bucket(start, stop, params, group, size)
        self.buckets.append(bucket)
        for param in params:
            self.bucket_of[param] = bucket
        return bucket

    def start_step(self, micro_batches: int) -> None:
        """Arms the hooks for a step of micro_batches backward passes."""
        self.micro_batches, self.active = micro_batches, True
        for bucket in self.buckets:
            bucket.pending, bucket.work, bucket.arrived = len(bucket.params), None, 0
        self.calls = dict.fromkeys(self.bucket_of, 0)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.active:
            return
        if self.level >= 2:
            self._accumulate(param)
            return
        param.main_grad.add_(param.grad)
        param.grad = None
        self.calls[param] += 1
        if self.calls[param] == self.micro_batches:
            bucket = self.bucket_of[param]
            bucket.pending -= 1
            if bucket.pending == 0 and self.overlap:
                self._launch(bucket)

    def _accumulate(self, param: nn.Parameter) -> None:
        """ZeRO-2 and 3: param's gradient into its bucket's micro-batch gradients; the bucket is
        reduce-scattered once each of its parameters has given it one more."""
        bucket = self.bucket_of[param]
        if bucket.view is None:
            size = bucket.stop - bucket.start
            bucket.view = torch.zeros(size, dtype=torch.float32, device=self.device)
        at = self.offsets[param] - bucket.start
        bucket.view[at : at + param.numel()].view_as(param).add_(param.grad)
        param.grad = None
        bucket.arrived += 1
        if bucket.arrived % len(bucket.params) == 0:
            self._reduce_scatter(bucket)

    def _reduce_scatter(self, bucket: Bucket) -> None:
        """ZeRO-2 and 3: starts the reduce-scatter of bucket's gradients (synchronous without
        the overlap), whose block _add_block adds to the kept one."""
        grads, bucket.view = bucket.view, None
        work = comm.reduce_scatter_in_place(grads, bucket.group, async_op=self.overlap)
        self.in_flight.append((bucket, grads, work))
        while len(self.in_flight) > (IN_FLIGHT if self.overlap else 0):
            self._add_block(*self.in_flight.popleft())
        if self.shards is not None:
            self.shards.backward_done(bucket)

    @staticmethod
    def _add_block(bucket: Bucket, grads: torch.Tensor, work) -> None:
        if work is not None:
            work.wait()
        bucket.block.add_(grads.view(bucket.size, -1)[bucket.rank])

    def _launch(self, bucket: Bucket) -> None:
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
        if self.level >= 2:
            self._finish_blocks()
            return
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

    def _finish_blocks(self) -> None:
        """ZeRO-2 and 3: the last reduce-scatters (of buckets some parameter of which gave no
        gradient) started, every block added and divided by dp x cp; ZeRO-3's parameters
        freed."""
        for bucket in self.buckets:
            if bucket.view is not None:
                self._reduce_scatter(bucket)
        while self.in_flight:
            self._add_block(*self.in_flight.popleft())
        if self.ps.dp_cp > 1:
            torch._foreach_mul_([b.block for b in self.buckets], 1.0 / self.ps.dp_cp)
        if self.shards is not None:
            self.shards.free_all()

    def overlap_param_gather(self, uses: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """ZeRO-1: gather_params() starts the buckets' all-gathers asynchronously, in the
        order the forward needs them (uses: (module, parameters it needs), in forward order:
        model.forward_param_uses), and a forward pre-hook on each module waits for its
        parameters' buckets, so the gathers overlap the next forward."""
        need: dict[int, int] = {}  # bucket index -> first use
        index_of = {id(b): i for i, b in enumerate(self.buckets)}
        for use, (buckets, module) in enumerate(self._bucket_uses(uses)):
            for bucket in buckets:
                need.setdefault(index_of[id(bucket)], use)
            hook = module.register_forward_pre_hook(lambda *_, b=buckets: self.wait_params(b))
            self._hooks.append(hook)
        # a bucket no module claims goes first (read before any module runs)
        self.gather_order = sorted(self.buckets, key=lambda b: need.get(index_of[id(b)], -1))

    def gather_params(self) -> None:
        """ZeRO-1, after the optimizer updated this rank's blocks: every bucket's parameters
        all-gathered over its group, in place (started only, with overlap_param_gather).
        Nothing under ZeRO-3: each module gathers its own when it runs."""
        if self.shards is not None:
            return
        order = self.gather_order
        for bucket in order or self.buckets:
            bucket.gather = comm.all_gather_in_place(
                bucket.params_view, bucket.group, async_op=order is not None
            )

    def wait_params(self, buckets: list[Bucket] | None = None) -> None:
        """Waits for the parameter all-gathers of buckets (default: all) still in flight."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None

    def whole(self, write_back: bool = False):
        """A context in which every buffered parameter is whole (a checkpoint reads them, or
        with write_back loads them): ZeRO-1 and 2's gathers waited for, ZeRO-3's buckets
        gathered and freed after."""
        if self.shards is not None:
            return self.shards.gathered(write_back)
        self.wait_params()
        return contextlib.nullcontext()

    def gather_block(self, bucket: Bucket, block: torch.Tensor) -> torch.Tensor:
        """ZeRO-1: a bucket-sized tensor whose block r is rank r's `block` (e.g. an optimizer
        state laid out like bucket's block), gathered over bucket's group."""
        full = block.new_zeros(bucket.stop - bucket.start)
        full.view(bucket.size, -1)[bucket.rank].copy_(block)
        comm.all_gather_in_place(full, bucket.group)
        return full

    def zero(self) -> None:
        """Clears the buffer (ZeRO-2 and 3: the blocks; and the buffered parameters' .grad) for
        the next step."""
        (self.grad_blocks if self.level >= 2 else self.buffer).zero_()
        for param in self.bucket_of:
            param.grad = None
