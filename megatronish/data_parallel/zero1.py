"""ZeRO-1 (Megatron's distributed optimizer): the optimizer state sharded over the group."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from megatronish.data_parallel.base import Uses
from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.outside import WholeOwners
from megatronish.data_parallel.zero0 import Zero0
from megatronish.distributed import comm
from megatronish.layers.roles import role
from megatronish.optim.clip import Squares, squares
from megatronish.optim.interface import Update


class Zero1(Zero0):
    """Each bucket is padded to a multiple of its group's size n, and rank r keeps shard r of it:
    the bucket's gradients, in ZeRO-0's whole buffer, are reduce-scattered instead of
    all-reduced (rank r gets shard r reduced; only it is divided by dp x cp), and the optimizer
    (`optim`) updates the pieces of the parameters in this rank's shards (its moments one
    tensor per shard, `shard_state`). The buckets' parameters keep no .grad: their reduced
    gradient is only in the pieces. The parameters live in one flat buffer laid out like the
    gradients; after the step each bucket is all-gathered in place, with the overlap
    asynchronously in the order the next forward needs them, each module's forward pre-hook
    waiting for its own buckets. The parameters outside the buckets are owned whole
    (outside.WholeOwners).

    Collectives per step: a reduce-scatter and a parameter all-gather per bucket, a broadcast
    per parameter outside the buckets (the gradients of those the optimizer needs whole,
    Muon's, reduced to their owner alone, which counts their squares as its shards'), and for
    the gradient norm an all-reduce of the shards' squares over the dp x cp group (and one over
    the expert-data-parallel group with experts).
    A checkpoint gathers each bucket's optimizer moments over its group."""

    zero = True

    def _lay_out(self, uses: Uses) -> None:
        self._lay_out_grads()
        self._lay_out_params()
        for bucket in self.buckets:
            self.layout.cut_pieces(bucket, self._param_shard(bucket))
        self.pieces = [piece for bucket in self.buckets for piece in bucket.pieces]
        self.owners = WholeOwners(self.outside, self.ps, self.to_owner)
        self._hook_modules(uses)

    def _lay_out_grads(self) -> None:
        super()._lay_out_grads()
        for bucket in self.buckets:
            lo = bucket.shard_start
            bucket.grad_shard = self.grad_buffer[lo : lo + bucket.shard_size]

    def _lay_out_params(self) -> None:
        """Moves the buckets' parameters into one flat buffer laid out like the gradients."""
        layout = self.layout
        dtypes = {p.dtype for p in layout.members}
        assert len(dtypes) <= 1, f"ZeRO buffers parameters of one dtype, not {dtypes}"
        dtype = dtypes.pop() if dtypes else None
        self.flat_params = torch.zeros(layout.size, dtype=dtype, device=layout.device)
        for param in layout.members:
            flat = layout.flat_view(self.flat_params, param)
            flat.copy_(param.data)
            param.data = flat
        for bucket in self.buckets:
            bucket.params_view = self.flat_params[bucket.start : bucket.stop]

    def _param_shard(self, bucket: Bucket) -> torch.Tensor:
        """This rank's shard of bucket's parameters (what the optimizer updates)."""
        return self.flat_params[bucket.shard_start : bucket.shard_start + bucket.shard_size]

    def _hook_modules(self, uses: Uses) -> None:
        """With the overlap: _gather_params starts the buckets' all-gathers asynchronously, in
        the order the forward needs them, and a forward pre-hook on each module waits for its
        parameters' buckets, so the gathers overlap the next forward."""
        self.gather_order: list[Bucket] | None = None
        if not self.overlap:
            return
        need: dict[int, int] = {}  # bucket index -> first use
        index_of = {id(b): i for i, b in enumerate(self.buckets)}
        for use, (buckets, module) in enumerate(self.layout.bucket_uses(uses)):
            for bucket in buckets:
                need.setdefault(index_of[id(bucket)], use)
            hook = module.register_forward_pre_hook(lambda *_, b=buckets: self._wait_params(b))
            self._hooks.append(hook)
        # a bucket no module claims goes first (read before any module runs)
        self.gather_order = sorted(self.buckets, key=lambda b: need.get(index_of[id(b)], -1))

    # ---- gradients

    def _reduce(self, bucket: Bucket):
        return comm.reduce_scatter_in_place(bucket.sent, bucket.group, async_op=True)

    @staticmethod
    def _kept(bucket: Bucket, reduced: torch.Tensor) -> torch.Tensor:
        return reduced.view(bucket.size, -1)[bucket.rank]

    def _finish_buckets(self) -> None:
        self._wait_params()  # a parameter no forward used
        self._reduce_all()

    def _reduced_to(self) -> dict[int, int]:
        return self.owners.reduced_to

    def _add_shard_squares(self, local: Squares) -> Squares:
        """Adds the squares of this rank's shards and of the gradients reduced to it alone
        (owned whole: outside.WholeOwners), summed over their groups."""
        if not self.buckets and not self.to_owner:
            return local
        whole = [p for p in self.params if id(p) in self.to_owner]
        owned = [(p, p.grad) for p in whole if p.grad is not None]
        pieces = [(x.param, x.grad) for x in self.pieces] + owned
        shards = squares(pieces, self.params[0].device, self.ps.tp)
        dense = torch.stack([shards.split, shards.replicated])
        comm.all_reduce(dense, self.ps.dp_cp_group, op=dist.ReduceOp.SUM)
        if any(role(p).is_expert for p in [b.params[0] for b in self.buckets] + whole):
            comm.all_reduce(shards.expert, self.ps.edp_group, op=dist.ReduceOp.SUM)
        return Squares(
            local.split + dense[0], local.replicated + dense[1], local.expert + shards.expert
        )

    def _shard_grads(self) -> list:
        return [piece.grad for piece in self.pieces]

    # ---- parameters

    def _after_update(self) -> None:
        self.owners.broadcast()
        self._gather_params()

    def _gather_params(self) -> None:
        """Every bucket's parameters all-gathered over its group, in place (only started, with
        the overlap)."""
        order = self.gather_order
        for bucket in order or self.buckets:
            bucket.gather = comm.all_gather_in_place(
                bucket.params_view, bucket.group, async_op=order is not None
            )

    def _wait_params(self, buckets: list[Bucket] | None = None) -> None:
        """Waits for the parameter all-gathers of buckets (default: all) still in flight."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.gather is not None:
                bucket.gather.wait()
                bucket.gather = None

    def make_whole(self) -> None:
        self._wait_params()

    def whole_params(self, write_back: bool = False, params: list | None = None):
        self._wait_params()
        return contextlib.nullcontext()

    # ---- optimizer state

    def _make_update(self, groups: list[dict]) -> Update:
        """The optimizer over the parameters this rank owns whole and the pieces of its shards,
        the pieces' moments views of one tensor per bucket's shard (`shard_state`)."""
        owned = {id(p) for p in self.owners.owned}
        shares = []
        for group in groups:
            members = {id(p) for p in group["params"]}
            whole = [p for p in group["params"] if id(p) in owned]
            pieces = [piece.data for piece in self.pieces if id(piece.param) in members]
            shares.append({**group, "params": whole + pieces})
        update = super()._make_update(shares)
        spec = self.optim.state
        self.shard_state = []
        for bucket in self.buckets:
            moments = {k: torch.zeros_like(bucket.grad_shard) for k in spec.sharded}
            self.shard_state.append(moments)
            for piece in bucket.pieces:
                lo = piece.at - bucket.shard_start
                at = slice(lo, lo + piece.data.numel())
                zero = torch.zeros((), dtype=torch.float32, device=piece.data.device)
                update.state[piece.data] = {
                    **{k: zero.clone() for k in spec.scalars},
                    **{k: v[at] for k, v in moments.items()},
                }
        return update

    def held(self) -> list[nn.Parameter]:
        held = {id(p) for p in self.owners.owned} | {id(piece.param) for piece in self.pieces}
        return [p for p in self.params if id(p) in held]

    def states_to_save(self) -> dict[nn.Parameter, dict]:
        """The whole state of the parameters this rank owns whole and, of each bucket, of
        those that start in its shard (the shards are gathered over the bucket's group: every
        rank of it calls this)."""
        whole = super().states_to_save()
        for bucket, moments in zip(self.buckets, self.shard_state):
            full = {k: self._gather_shard(bucket, v) for k, v in moments.items()}
            for piece in bucket.pieces:
                if piece.lo != 0:
                    continue  # the parameter starts in an earlier shard: saved by its rank
                param, at = piece.param, piece.at - bucket.start
                span = slice(at, at + param.numel())
                scalars = self.update.state[piece.data]
                whole[param] = {
                    **{k: scalars[k] for k in self.optim.state.scalars},
                    **{k: v[span].view_as(param).clone() for k, v in full.items()},
                }
        return whole

    @staticmethod
    def _gather_shard(bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        """A bucket-sized tensor whose shard r is rank r's `shard` (a tensor laid out like
        bucket's shard), gathered over bucket's group."""
        full = shard.new_zeros(bucket.stop - bucket.start)
        full.view(bucket.size, -1)[bucket.rank].copy_(shard)
        comm.all_gather_in_place(full, bucket.group)
        return full

    def load_states(self, read) -> None:
        """read(param) (None: fresh) into the whole states this rank owns and its pieces."""
        state, spec = self.update.state, self.optim.state
        for param in [p for p in list(state) if isinstance(p, nn.Parameter)]:
            del state[param]
        states = {id(p): read(p) for p in self.held()}
        for param in self.owners.owned:
            if states[id(param)] is not None:
                state[param] = states[id(param)]
        for piece in self.pieces:
            saved, mine = states[id(piece.param)], state[piece.data]
            part = slice(piece.lo, piece.lo + piece.data.numel())
            for kind in spec.scalars:
                mine[kind].copy_(saved[kind] if saved is not None else 0.0)
            for kind in spec.sharded:
                if saved is None:
                    mine[kind].zero_()
                else:
                    mine[kind].copy_(saved[kind].reshape(-1)[part])
