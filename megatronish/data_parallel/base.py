"""What every ZeRO level shares: the bucket layout, the hooks that hand each gradient to the
level, the plain reduction of the parameters outside the buckets, the gradient norm, the
optimizer's update (optim.interface) and the step loop's calls."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch
from torch import nn

from megatronish.config import Config
from megatronish.data_parallel.buckets import REDUCE_DTYPES, Bucket, BucketLayout, on_the_wire
from megatronish.data_parallel.outside import reduce_gradients
from megatronish.distributed.layout import ParallelState
from megatronish.layers.roles import role
from megatronish.optim.clip import Squares, clip_, global_norm, squares
from megatronish.optim.interface import Optimizer, Update
from megatronish.optim.registry import optimizer_named

# (module, the parameters used from its call on), in the order a forward calls the modules
Uses = list[tuple[nn.Module, list[nn.Parameter]]]


class DataParallel(ABC):
    """The data-parallel side of training a model on this rank, the one object the step loop
    calls: the gradients reduced over the dp x cp group (expert weights over their
    expert-data-parallel group), in buckets overlapped with backward and, for the parameters
    outside them, after it (data_parallel.outside); the gradient norm and clipping; the
    optimizer's update (`optim`: AdamW) of what this rank updates; the parameters made whole
    where a level shards them. A subclass per ZeRO level (zero0 .. zero3) says where the
    buckets' gradients, parameters and optimizer state live and which collectives move them;
    data_parallel.data_parallel_for picks it.

    Each step: start_of_step(micro_batches) before the first backward, after_backward() after
    the last, clip_grads(max_norm), step(lr) unless the step is skipped, after_step(). Besides:
    after_eval() after forward passes without backward, whole_params() around reading or
    loading the parameters (a checkpoint), make_whole() when a run ends (the model is returned
    whole), states_to_save() and load_states() for the checkpoint's optimizer state.

    `model` is a GPT (forward_param_uses places the hooks of the levels that gather parameters
    for a module); with buckets=False every gradient takes the plain reduction and, under
    ZeRO, every parameter is owned whole (the reference the buckets are held to), as under ZeRO
    are those the optimizer needs whole (optim.needs_whole: Muon's matrices, the layer-wise
    way: each one's gradient reduced to the one rank that owns it, which updates and
    broadcasts it)."""

    zero = False
    """Whether the optimizer state is split over the group (each rank saves its part)."""

    def __init__(self, model: nn.Module, cfg: Config, ps: ParallelState, buckets: bool = True):
        self.cfg, self.ps = cfg, ps
        optim = cfg.optim
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.bucket_bytes = int(optim.bucket_mb * 2**20)
        self.overlap = optim.overlap_grad_reduce
        self.reduce_dtype = REDUCE_DTYPES[optim.grad_reduce_dtype]
        uses = model.forward_param_uses()
        self.optim: Optimizer = optimizer_named(optim.name)
        whole = {id(p) for p in self.optim.needs_whole(model)} if self.zero else set()
        members = [p for p in self.params if id(p) not in whole] if buckets else []
        parts = self._parts(uses)
        self.layout = BucketLayout(members, ps, self.bucket_bytes, padded=self.zero, part_of=parts)
        self.buckets = self.layout.buckets
        self.outside = [p for p in self.params if not self.layout.holds(p)]
        # under ZeRO: the parameters whose reduced gradient only their owner holds
        self.to_owner = frozenset(id(p) for p in self.outside if id(p) in whole)
        self.micro_batches, self.active = 0, False
        self.calls: dict[nn.Parameter, int] = {}  # micro-batch gradients this step
        self._hooks: list = []
        self._lay_out(uses)
        self.update = self._make_update(self.optim.param_groups(model, cfg.train.weight_decay))
        hook = self._on_grad
        self._hooks += [p.register_post_accumulate_grad_hook(hook) for p in self.layout.members]

    # ---- the step loop's calls

    def start_of_step(self, micro_batches: int) -> None:
        """Arms the gradient hooks for a step of micro_batches backward passes."""
        self.micro_batches, self.active = micro_batches, True
        for bucket in self.buckets:
            bucket.pending, bucket.work, bucket.arrived = len(bucket.params), None, 0
        self.calls = dict.fromkeys(self.layout.bucket_of, 0)

    def after_backward(self) -> None:
        """Every gradient of the step reduced and divided by dp x cp: the buckets' (those not
        started yet started, then each waited for), then those outside the buckets."""
        self.active = False
        self._finish_buckets()
        reduce_gradients(
            self.outside, self.ps, self.bucket_bytes, self.reduce_dtype, self._reduced_to()
        )

    def clip_grads(self, max_norm: float) -> float:
        """The global gradient norm (optim.clip; the last stage's copy of tied embeddings left
        out), the gradients scaled down to max_norm when it is exceeded (0: never). Returns
        the norm before clipping."""
        with_grad = [p for p in self.params if p.grad is not None]
        counted = [
            (p, p.grad)
            for p in with_grad
            if not role(p).pipeline_duplicate and id(p) not in self.to_owner
        ]
        local = self._add_shard_squares(squares(counted, self.params[0].device, self.ps.tp))
        norm = global_norm(local, self.ps)
        clip_([p.grad for p in with_grad] + self._shard_grads(), norm, max_norm)
        return norm

    def step(self, lr: float) -> None:
        """The optimizer's update at learning rate lr of what this rank updates, then the
        updated parameters sent where the level needs them."""
        for group in self.update.param_groups:
            group["lr"] = lr
        self.update.step()
        self._after_update()

    def after_step(self) -> None:
        """Clears the gradients for the next step."""
        for param in self.params:
            param.grad = None
        self._clear_grads()

    def after_eval(self) -> None:  # noqa: B027 (a level with nothing to do)
        """After forward passes without a backward (evaluation): what they left gathered is
        freed (ZeRO-3)."""

    def make_whole(self) -> None:  # noqa: B027 (a level with nothing to do)
        """Every parameter whole on this rank (at the end of a run)."""

    def whole_params(self, write_back: bool = False, params: list | None = None):
        """A context in which every parameter is whole (a checkpoint reads them, or with
        write_back loads them, and the level takes its shards from them after), or at least
        `params` (ZeRO-3 then gathers only what holds them); every rank of the group enters
        it."""
        return contextlib.nullcontext()

    # ---- the checkpoint's optimizer state

    def states_to_save(self) -> dict[nn.Parameter, dict]:
        """The whole optimizer state (by optim.state's names, each moment the parameter's
        shape) of the parameters this rank saves."""
        return {p: st for p, st in self.update.state.items() if isinstance(p, nn.Parameter)}

    def load_states(self, read) -> None:
        """Replaces the optimizer state with read(param) (a dict as states_to_save gives, or None:
        the parameter starts fresh) for every parameter this rank updates."""
        self.update.state.clear()
        for param in self.held():
            state = read(param)
            if state is not None:
                self.update.state[param] = state

    def held(self) -> list[nn.Parameter]:
        """The parameters whose optimizer state (or part of it) this rank holds."""
        held = {id(p) for g in self.update.param_groups for p in g["params"]}
        return [p for p in self.params if id(p) in held]

    def close(self) -> None:
        """Removes the hooks: the parameters' gradients are autograd's own again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ---- what a level says

    def _parts(self, uses: Uses) -> dict[nn.Parameter, int] | None:
        """Where buckets must end besides their size (layout.BucketLayout's part_of)."""
        return None

    @abstractmethod
    def _lay_out(self, uses: Uses) -> None:
        """Makes the level's storage of the buckets' gradients (and parameters)."""

    def _make_update(self, groups: list[dict]) -> Update:
        """The optimizer over groups (its param_groups of the model), or this rank's share of
        them."""
        return self.optim.build(groups, self.cfg)

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.active:
            self._take_grad(param)

    @abstractmethod
    def _take_grad(self, param: nn.Parameter) -> None:
        """A bucketed parameter's micro-batch gradient (in param.grad) taken into its bucket."""

    def _sent(self, bucket: Bucket, grads: torch.Tensor) -> torch.Tensor:
        """What bucket's reduction of its fp32 gradients `grads` (bucket-sized) sends:
        buckets.on_the_wire in optim.grad_reduce_dtype (grads itself in fp32 or over a group
        of one rank, where nothing is sent)."""
        if bucket.size == 1:
            return grads
        return on_the_wire(grads, 1.0 / self.ps.dp_cp, self.reduce_dtype)

    def _divided_before(self, bucket: Bucket) -> bool:
        """Whether bucket's gradients are divided by dp x cp before their reduction (in
        _sent: a bf16 reduction) rather than after it."""
        return bucket.size > 1 and self.reduce_dtype != torch.float32

    @staticmethod
    def _kept(bucket: Bucket, reduced: torch.Tensor) -> torch.Tensor:
        """The part of the bucket-sized `reduced` this rank keeps (ZeRO-0: all of it)."""
        return reduced

    @abstractmethod
    def _finish_buckets(self) -> None:
        """Every bucket's reduction of the step done and divided by dp x cp."""

    def _reduced_to(self) -> dict[int, int] | None:
        """The parameters whose gradients are reduced to one rank (outside.reduce_gradients'
        owners; None: every gradient all-reduced)."""
        return None

    def _add_shard_squares(self, local: Squares) -> Squares:
        """local with the squares of the gradients only this rank holds added (ZeRO: its
        shards' and its own whole parameters' reduced to it)."""
        return local

    def _shard_grads(self) -> list:
        """The gradients clipping scales besides the parameters' .grad (ZeRO's shards)."""
        return []

    def _after_update(self) -> None:  # noqa: B027 (a level with nothing to do)
        """After the optimizer's update: the parameters sent where they are needed (ZeRO)."""

    @abstractmethod
    def _clear_grads(self) -> None:
        """The buckets' gradients zeroed for the next step."""
