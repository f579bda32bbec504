"""The bucket layout of data parallelism: which parameters' gradients go through buckets, their
places in one flat layout (the reverse of the parameters' order, the order backward produces
their gradients), the buckets it is cut into, and under ZeRO each bucket's shards (one per
rank of its group) and the pieces of the parameters in this rank's shard.

A bucket holds parameters reduced over one group: the dp x cp group, or for expert weights
(MoE, split over ep) the expert-data-parallel group (the ranks that hold the same experts).
"""

from __future__ import annotations

import torch
from torch import nn

from megatronish.distributed.layout import ParallelState
from megatronish.layers.roles import role

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # optim.grad_reduce_dtype


def on_the_wire(grads: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a data-parallel reduction of the fp32 `grads` sends in `dtype`: grads itself in
    fp32 (the sum is divided by dp x cp after it), otherwise a new tensor, grads times scale
    (1 / dp x cp) rounded to dtype: divided before the reduction, as Megatron applies its
    gradient scaling factor to the buffer before the collective."""
    if dtype == grads.dtype:
        return grads
    return (grads * scale).to(dtype)


def bucketed(param: nn.Parameter) -> bool:
    """Whether param's gradient goes through the buckets: not one summed over another group
    first (a sequence-parallel replicated parameter over tp, a tied embedding's pipeline copy
    over the embedding group), which the plain reduction (data_parallel.outside) takes."""
    tags = role(param)
    return not (tags.sequence_parallel_grad or tags.pipeline_tied)


class Piece:
    """The part of a parameter in this rank's shard of a bucket (ZeRO): `data`, a 1-D view of
    the parameter's values there, carrying the matching part of the reduced gradient as
    `.grad` (so AdamW updates it as it updates a whole parameter); lo: where it starts in the
    flattened parameter; at: where in the flat layout."""

    def __init__(
        self, param: nn.Parameter, data: torch.Tensor, grad: torch.Tensor, lo: int, at: int
    ):
        self.param, self.data, self.lo, self.at = param, data, lo, at
        self.data.grad = grad

    @property
    def grad(self) -> torch.Tensor:
        return self.data.grad


class Bucket:
    """A run of parameters reduced together over `group` (of `size` ranks; this one is its
    `rank`), from start to stop in the flat layout (under ZeRO padded to a multiple of size:
    shard r, the r-th (stop - start) / size elements, is rank r's).

    What the levels keep in it: `view`, the bucket's gradients (ZeRO-0 and 1: a view of the
    whole buffer; ZeRO-2 and 3: those of the micro-batches since its last reduce-scatter, None
    between them); `work`, its reduction in flight, and `sent`, what that reduction carries
    (ZeRO-0 and 1: `view`, or its bf16 copy with optim.grad_reduce_dtype bf16); `grad_shard`,
    what this rank keeps of the reduced gradients (ZeRO-0 all of them, ZeRO its shard) and
    `pieces`, the parameters' parts in the shard (ZeRO); `params_view` and `gather`, its
    parameters in the flat parameter buffer and their all-gather in flight (ZeRO-1 and 2).
    ZeRO-3's param_shards.ParamShards adds its own (the gathered parameters `full`, this rank's
    `param_shard`, their state of use)."""

    def __init__(
        self, start: int, stop: int, params: list[nn.Parameter], group, size: int, rank: int
    ):
        self.start, self.stop, self.params = start, stop, params
        self.group, self.size, self.rank = group, size, rank
        self.view: torch.Tensor | None = None
        self.work = None
        self.sent: torch.Tensor | None = None
        self.pending = 0  # parameters still to produce their last micro-batch's gradient
        self.arrived = 0  # ZeRO-2 and 3: gradients the bucket received this step
        self.grad_shard: torch.Tensor | None = None
        self.pieces: list[Piece] = []
        self.params_view: torch.Tensor | None = None
        self.gather = None

    @property
    def shard_size(self) -> int:
        return (self.stop - self.start) // self.size

    @property
    def shard_start(self) -> int:
        """Where this rank's shard starts in the flat layout."""
        return self.start + self.rank * self.shard_size


class BucketLayout:
    """The bucketed parameters of `params` (those whose gradient is `bucketed`) laid out flat
    in reverse order and cut into buckets of about bucket_bytes of fp32 gradients, a new bucket
    wherever the group changes (experts) or, with `part_of` (ZeRO-3), the part a parameter
    belongs to. With `padded` (ZeRO) each bucket is padded to a multiple of its group's size."""

    def __init__(
        self,
        params: list[nn.Parameter],
        ps: ParallelState,
        bucket_bytes: int,
        padded: bool,
        part_of: dict[nn.Parameter, int] | None = None,
    ):
        self.ps = ps
        self.members = [p for p in reversed(params) if bucketed(p)]
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        self.offsets: dict[nn.Parameter, int] = {}
        part_of = part_of or {}
        start = offset = 0
        current: list[nn.Parameter] = []
        for index, param in enumerate(self.members):
            self.offsets[param] = offset
            offset += param.numel()
            current.append(param)
            following = self.members[index + 1] if index + 1 < len(self.members) else None
            if (
                following is None
                or (offset - start) * 4 >= bucket_bytes
                or role(following).is_expert != role(param).is_expert
                or part_of.get(following) != part_of.get(param)
            ):
                bucket = self._add_bucket(start, offset, current)
                if padded:  # equal shards
                    offset += -(offset - start) % bucket.size
                    bucket.stop = offset
                start, current = offset, []
        self.size = offset
        self.device = self.members[0].device if self.members else ps.device

    def _add_bucket(self, start: int, stop: int, params: list[nn.Parameter]) -> Bucket:
        ps = self.ps
        if role(params[0]).is_expert:
            group, size, rank = ps.edp_group, ps.edp, ps.edp_rank
        else:
            group, size, rank = ps.dp_cp_group, ps.dp_cp, ps.dp_cp_rank
        bucket = Bucket(start, stop, params, group, size, rank)
        self.buckets.append(bucket)
        for param in params:
            self.bucket_of[param] = bucket
        return bucket

    def holds(self, param: nn.Parameter) -> bool:
        """Whether param's gradient is reduced in a bucket (the others: data_parallel.outside)."""
        return param in self.bucket_of

    def flat_view(self, flat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        """param's place in `flat` (a tensor laid out like the buckets), shaped like param."""
        at = self.offsets[param]
        return flat[at : at + param.numel()].view_as(param)

    def bucket_uses(
        self, uses: list[tuple[nn.Module, list[nn.Parameter]]]
    ) -> list[tuple[list[Bucket], nn.Module]]:
        """(the buckets of the parameters it needs, module) of each module of uses that needs
        bucketed parameters, in forward order (uses: model.forward_param_uses)."""
        out = []
        for module, params in uses:
            held = {id(self.bucket_of[p]): self.bucket_of[p] for p in params if self.holds(p)}
            if held:
                out.append((list(held.values()), module))
        return out

    def cut_pieces(self, bucket: Bucket, param_shard: torch.Tensor) -> None:
        """Lists in bucket.pieces the parts of its parameters in this rank's shard, whose
        values are param_shard and whose gradients bucket.grad_shard (set first)."""
        lo = bucket.shard_start
        hi = lo + bucket.shard_size
        for param in bucket.params:
            start = self.offsets[param]
            a, b = max(lo, start), min(hi, start + param.numel())
            if a < b:
                grad = bucket.grad_shard[a - lo : b - lo]
                bucket.pieces.append(Piece(param, param_shard[a - lo : b - lo], grad, a - start, a))
