"""ZeRO-3's parameters: each rank keeps only its shard of every bucket's parameters, and a
bucket's whole parameters exist only while a module uses them.

Each bucket (data_parallel.buckets) gets its own flat parameter tensor laid out like its
gradients, whose parameters are views; between uses its storage is resized to nothing (the
views stay valid, so tensors autograd saved in forward see the parameters again once the
bucket is gathered back). `owned` holds this rank's shard of every bucket (what the optimizer
updates). Gathering a bucket reallocates its storage, writes this rank's shard into it and
all-gathers the shards over the bucket's group (comm.all_gather_in_place).

The modules of GPT.forward_param_uses drive it: a forward pre-hook gathers the module's buckets
(and starts the next module's gather: the prefetch), the forward hook frees them and hooks the
module's output, whose gradient, when backward reaches it, gathers them again (and starts the
previous module's); a bucket is freed again when ZeRO-3 has reduce-scattered its gradients of
that backward (`backward_done`). The last module (the final norm, followed by the output layer,
which is not called as a module) keeps its buckets from its forward to its backward; so do
tied embeddings, which the output layer reads again, until the embedding's backward. A
recomputed forward (activation checkpointing) runs inside its module's backward, while the
buckets are held. An embedding's backward (a scatter of the output's gradient into the rows
looked up) reads no weight, so its buckets are not gathered for it. With several micro-batches
in flight (pp > 1) the buckets stay gathered from their first use to the step's end
(`free_all`), so every bucket is gathered once a step; evaluation, which has no backward,
frees the kept ones with free_all as well.

Per micro-batch at pp = 1 that is one all-gather of every bucket forward, plus the tied
embedding's bucket again for the output layer, and one of every bucket but the last module's,
the tied embedding's and the embeddings' backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from megatronish.distributed import comm
from megatronish.layers.embedding import VocabParallelEmbedding

# Modules whose backward reads no parameter of theirs (a lookup's gradient is a scatter).
_LOOKUPS = (nn.Embedding, VocabParallelEmbedding)


@dataclass
class _Use:
    """A module's buckets (`own`), the next module's (`ahead`) and the previous one's
    (`behind`, empty when that backward reads no parameter) in forward order; keep: held from
    the forward to the backward (the last module's); backward: whether the module's backward
    reads its parameters; counted: whether the forward running now took a use of own."""

    own: list
    ahead: list
    behind: list
    keep: bool
    backward: bool
    counted: bool = False


class ParamShards:
    """The sharded parameters of `buckets` (buckets.Bucket: .start, .stop, .params, .group,
    .size and .rank, this rank's index in the group; `offsets`: each parameter's start in the
    flat layout). `overlap`: gathers start asynchronously, and with
    `prefetch` one module ahead; `keep_for_step`: a gathered bucket stays until free_all."""

    def __init__(
        self,
        buckets: list,
        offsets: dict[nn.Parameter, int],
        overlap: bool,
        prefetch: bool,
        keep_for_step: bool,
    ):
        self.buckets, self.overlap = buckets, overlap
        self.prefetch, self.keep_for_step = prefetch and overlap, keep_for_step
        dtypes = {p.dtype for b in buckets for p in b.params}
        assert len(dtypes) <= 1, f"ZeRO-3 shards parameters of one dtype, not {dtypes}"
        dtype = dtypes.pop() if dtypes else torch.float32
        device = buckets[0].params[0].device if buckets else None
        sizes = [(b.stop - b.start) // b.size for b in buckets]
        self.owned = torch.zeros(sum(sizes), dtype=dtype, device=device)
        at = 0
        for bucket, size in zip(buckets, sizes):
            bucket.full = torch.zeros(bucket.stop - bucket.start, dtype=dtype, device=device)
            for param in bucket.params:
                lo = offsets[param] - bucket.start
                flat = bucket.full[lo : lo + param.numel()]
                flat.copy_(param.data.reshape(-1))
                param.data = flat.view_as(param)
            bucket.param_shard = self.owned[at : at + size]
            bucket.param_shard.copy_(bucket.full.view(bucket.size, -1)[bucket.rank])
            bucket.users, bucket.held, bucket.fetch, bucket.resident = 0, False, None, True
            self._free(bucket)
            at += size
        self._hooks: list = []

    # ---- gathering and freeing

    def _start(self, bucket) -> None:
        """Starts gathering bucket's parameters (nothing if they are there or on their way)."""
        if bucket.resident:
            return
        storage = bucket.full.untyped_storage()
        storage.resize_(bucket.full.numel() * bucket.full.element_size())
        bucket.resident = True
        bucket.full.view(bucket.size, -1)[bucket.rank].copy_(bucket.param_shard)
        bucket.fetch = comm.all_gather_in_place(bucket.full, bucket.group, self.overlap)

    def _wait(self, bucket) -> None:
        if bucket.fetch is not None:
            bucket.fetch.wait()
            bucket.fetch = None

    def _free(self, bucket) -> None:
        self._wait(bucket)
        bucket.full.untyped_storage().resize_(0)
        bucket.resident = False

    def _maybe_free(self, bucket) -> None:
        if bucket.resident and bucket.users == 0 and not bucket.held and not self.keep_for_step:
            self._free(bucket)

    def _ready(self, buckets: list) -> None:
        """Gathers buckets (those not there yet) and waits for them."""
        for bucket in buckets:
            self._start(bucket)
        for bucket in buckets:
            self._wait(bucket)

    def backward_done(self, bucket) -> None:
        """bucket's gradients of this backward are reduce-scattered: no module of this
        micro-batch needs its parameters any more."""
        bucket.held = False
        self._maybe_free(bucket)

    def free_all(self) -> None:
        """Frees every bucket (between steps; none may be in use)."""
        for bucket in self.buckets:
            assert bucket.users == 0, "a module still uses its parameters"
            bucket.held = False
            if bucket.resident:
                self._free(bucket)

    def gather_all(self) -> None:
        """Every bucket gathered (they are freed again after their next use)."""
        self._ready(self.buckets)

    @contextlib.contextmanager
    def gathered(self, write_back: bool = False, params: list | None = None):
        """Every parameter whole inside the body (a checkpoint reads or writes them), or only
        the buckets that hold `params` (the others stay shards: a stream of the weights holds
        one piece at a time); with write_back this rank's shards are taken from the parameters
        afterwards (they were loaded). Every rank of the buckets' groups enters it."""
        if params is None:
            buckets = self.buckets
        else:
            wanted = {id(param) for param in params}
            buckets = [b for b in self.buckets if any(id(p) in wanted for p in b.params)]
        self._ready(buckets)
        try:
            yield
        finally:
            for bucket in buckets:
                if write_back:
                    bucket.param_shard.copy_(bucket.full.view(bucket.size, -1)[bucket.rank])
                assert bucket.users == 0, "a module still uses its parameters"
                bucket.held = False
                self._free(bucket)

    # ---- the modules' hooks

    def register(self, uses: list[tuple[list, nn.Module]]) -> None:
        """Hooks each module of `uses` ((its buckets, module), in forward order; modules
        without buckets left out): gathers before its forward and backward, frees after."""
        last = len(uses) - 1
        reads = [not isinstance(module, _LOOKUPS) for _, module in uses]
        for index, (buckets, module) in enumerate(uses):
            use = _Use(
                buckets,
                uses[index + 1][0] if index < last else [],
                uses[index - 1][0] if index > 0 and reads[index - 1] else [],
                keep=index == last,
                backward=reads[index],
            )
            self._hooks.append(module.register_forward_pre_hook(partial(self._before, use)))
            self._hooks.append(module.register_forward_hook(partial(self._after, use)))

    def _before(self, use: _Use, *_) -> None:
        # Inside the module's backward (its buckets held) this forward is a recompute, which
        # torch.utils.checkpoint may stop before the module's end: it takes no use of its own.
        use.counted = not any(bucket.held for bucket in use.own)
        for bucket in use.own:
            self._start(bucket)
        if self.prefetch and use.counted:
            for bucket in use.ahead:
                self._start(bucket)
        self._ready(use.own)
        if use.counted:
            for bucket in use.own:
                bucket.users += 1
                bucket.held |= use.keep

    def _after(self, use: _Use, _module, _args, output) -> None:
        if not use.counted:
            return
        for bucket in use.own:
            bucket.users -= 1
            self._maybe_free(bucket)
        if use.backward and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._before_backward(use))

    def _before_backward(self, use: _Use) -> None:
        # The last module's buckets stay from its forward until their reduce-scatter, after
        # which no backward reads them (under sequence parallelism the final norm's weight is
        # outside them, so the output layer's bucket may be done before the norm's backward).
        own = [] if use.keep else use.own
        for bucket in own:
            bucket.held = True
            self._start(bucket)
        if self.prefetch:
            for bucket in use.behind:
                self._start(bucket)
        self._ready(own)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
