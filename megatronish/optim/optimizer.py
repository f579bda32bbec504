"""AdamW, the learning-rate schedule, gradient reduction and clipping.

Parameters carry tags from megatronish.layers.linear.mark_parallel: tp_split_dim (None for
replicated parameters) and, under sequence parallelism, sequence_parallel_grad.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from megatronish.config import Config
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.moe import is_expert
from megatronish.optim.grad_buffer import GradBuffer


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup to train.lr over
    warmup_steps, then cosine decay to min_lr at train.steps."""
    t = cfg.train
    if t.warmup_steps > 0 and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (2-D and up: linear weights and embeddings) only."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def zero_owners(params: list[nn.Parameter], dp: int) -> list[int]:
    """Data-parallel rank that owns each parameter's optimizer state under ZeRO-1: greedy
    balancing of element counts, largest first, deterministic on every rank."""
    loads = [0] * dp
    owners = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        owner = min(range(dp), key=lambda d: (loads[d], d))
        owners[index] = owner
        loads[owner] += params[index].numel()
    return owners


class AdamW:
    """Decoupled-weight-decay Adam through PyTorch's fused kernel (torch._fused_adamw_, CPU and
    CUDA): the update torch.optim.AdamW(fused=True) makes, bit for bit, without torch.optim
    itself, whose wrappers import the compiler stack (about 2 s per process) on first use.

    param_groups: dicts with "params" and "weight_decay". state: parameter -> {"step" (fp32
    scalar tensor), "exp_avg", "exp_avg_sq"}, created at the parameter's first update (a
    parameter without a gradient is skipped, as torch.optim skips it)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float):
        self.param_groups = [{**g, "lr": lr, "betas": betas, "eps": eps} for g in groups]
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}

    def _state(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        state = self.state.get(param)
        if state is None:
            state = self.state[param] = {
                "step": torch.zeros((), dtype=torch.float32, device=param.device),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
        return state

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            by_kind: dict[tuple, list[nn.Parameter]] = {}
            for param in group["params"]:
                if param.grad is not None:
                    by_kind.setdefault((param.device, param.dtype), []).append(param)
            for params in by_kind.values():
                states = [self._state(p) for p in params]
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1)
                beta1, beta2 = group["betas"]
                torch._fused_adamw_(
                    params,
                    [p.grad for p in params],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [],
                    steps,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                )


class Optimizer:
    """AdamW over the model's parameters, or with optim.zero >= 1 over this rank's share of the
    dp x cp group's (expert weights: of their expert-data-parallel group's, the ranks that
    hold the same experts).

    With a sharding gradient buffer (grads.GradBuffer(zero >= 1), the trainer's) the share
    is this rank's block of every bucket: AdamW updates the pieces of the parameters in it
    (its state is laid out like the blocks) and the buffer all-gathers the updated blocks
    (under ZeRO-3 the modules gather them when they run).
    Parameters outside the buffer, and every parameter without one, are owned whole: greedy
    balancing over the group, and the owner broadcasts each updated parameter."""

    def __init__(
        self, model: nn.Module, cfg: Config, ps: ParallelState, grads: GradBuffer | None = None
    ):
        self.cfg, self.ps = cfg, ps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.zero = cfg.optim.zero >= 1 and ps.dp_cp > 1
        self.grads = grads if self.zero and grads is not None and grads.shard else None
        groups = param_groups(model, cfg.train.weight_decay)
        self.owners: list[tuple[nn.Parameter, int, int, object]] = []
        if self.zero:
            whole = [p for p in self.params if self.grads is None or not self.grads.holds(p)]
            dense = [p for p in whole if not is_expert(p)]
            experts = [p for p in whole if is_expert(p)]
            # (param, owner index, global rank of the owner, group to broadcast over)
            self.owners = [
                (p, o, ps.dp_cp_global_rank(o), ps.dp_cp_group)
                for p, o in zip(dense, zero_owners(dense, ps.dp_cp))
            ] + [
                (p, o, ps.edp_global_rank(o), ps.edp_group)
                for p, o in zip(experts, zero_owners(experts, ps.edp))
            ]
            owned = {
                id(p) for p, o, _, _ in self.owners
                if o == (ps.edp_rank if is_expert(p) else ps.dp_cp_rank)
            }  # fmt: skip
            pieces = self.grads.pieces if self.grads is not None else []
            groups = [
                {
                    **g,
                    "params": [p for p in g["params"] if id(p) in owned]
                    + [pc.data for pc in pieces if any(pc.param is p for p in g["params"])],
                }
                for g in groups
            ]
        self.inner = AdamW(
            groups, lr=cfg.train.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps
        )
        if self.grads is not None:
            self._lay_out_block_state()

    def _lay_out_block_state(self) -> None:
        """Each bucket's block of AdamW moments as one tensor (`block_state`), its pieces'
        states views of it, so the blocks can be gathered for a checkpoint."""
        self.block_state = []
        for bucket in self.grads.buckets:
            moments = {k: torch.zeros_like(bucket.block) for k in ("exp_avg", "exp_avg_sq")}
            self.block_state.append(moments)
            for piece in bucket.pieces:
                lo = piece.at - bucket.block_lo
                at = slice(lo, lo + piece.data.numel())
                self.inner.state[piece.data] = {
                    "step": torch.zeros((), dtype=torch.float32, device=piece.data.device),
                    **{k: v[at] for k, v in moments.items()},
                }

    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        # The owner's updated values go to every other rank of its group.
        for param, _, owner, group in self.owners:
            comm.broadcast(param.data, owner, group)
        if self.grads is not None:
            self.grads.gather_params()

    def whole_params(self, write_back: bool = False):
        """A context in which every parameter is whole (a checkpoint reads them, or with
        write_back loads them; ZeRO-3 gathers them for it); every rank enters it."""
        if self.grads is None:
            return contextlib.nullcontext()
        return self.grads.whole(write_back)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def held(self) -> list[nn.Parameter]:
        """The parameters whose state (or part of it) this rank holds."""
        held = {id(p) for g in self.inner.param_groups for p in g["params"]}
        pieces = self.grads.pieces if self.grads is not None else []
        held |= {id(pc.param) for pc in pieces}
        return [p for p in self.params if id(p) in held]

    def states_to_save(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The whole AdamW state ("step", "exp_avg", "exp_avg_sq", each the parameter's shape)
        of the parameters this rank saves: those it holds; under ZeRO-1 the ones it owns whole
        and, of a sharded bucket, those that start in its block (the blocks are gathered over
        the bucket's group: every rank of it calls this)."""
        whole = {p: st for p, st in self.inner.state.items() if isinstance(p, nn.Parameter)}
        if self.grads is None:
            return whole
        grads = self.grads
        for bucket, moments in zip(grads.buckets, self.block_state):
            full = {k: grads.gather_block(bucket, v) for k, v in moments.items()}
            block_hi = bucket.block_lo + bucket.block.numel()
            for piece in bucket.pieces:
                if piece.lo != 0:
                    continue  # the parameter starts in an earlier block: saved by its rank
                param, at = piece.param, piece.at - bucket.start
                assert bucket.block_lo <= piece.at < block_hi
                span = slice(at, at + param.numel())
                whole[param] = {
                    "step": self.inner.state[piece.data]["step"],
                    **{k: v[span].view_as(param).clone() for k, v in full.items()},
                }
        return whole

    def load_states(self, read) -> None:
        """Replaces the AdamW state with read(param) (a dict as states_to_save gives, or None:
        the parameter starts fresh) for every parameter this rank holds."""
        if self.grads is None:
            self.inner.state.clear()
            for param in self.held():
                state = read(param)
                if state is not None:
                    self.inner.state[param] = state
            return
        for param in [p for p in list(self.inner.state) if isinstance(p, nn.Parameter)]:
            del self.inner.state[param]
        states = {id(p): read(p) for p in self.held()}
        for param, _, _, _ in self.owners:
            if states.get(id(param)) is not None:
                self.inner.state[param] = states[id(param)]
        for piece in self.grads.pieces:
            state, mine = states[id(piece.param)], self.inner.state[piece.data]
            part = slice(piece.lo, piece.lo + piece.data.numel())
            mine["step"].copy_(state["step"] if state is not None else 0.0)
            for kind in ("exp_avg", "exp_avg_sq"):
                if state is None:
                    mine[kind].zero_()
                else:
                    mine[kind].copy_(state[kind].reshape(-1)[part])


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared elements of grads, as an fp64 scalar (per-tensor norms first)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()


def clip_grad_norm(
    params: list[nn.Parameter],
    max_norm: float,
    ps: ParallelState,
    sharded: GradBuffer | None = None,
) -> float:
    """Global gradient norm, each parameter counted once: the squares of tp-split gradients
    are summed over the tp group (experts' over the ep group first: each ep rank holds other
    experts), replicated ones are taken once, and the stages' sums are added over the
    pipeline (the last stage's copy of tied embeddings left out). Under ZeRO-1 the `sharded`
    buffer's pieces are this rank's blocks of its gradients (their parameters have no .grad):
    their squares are summed over the buckets' groups first. Scales the gradients down
    to max_norm when it is exceeded (max_norm 0: no clipping). Returns the norm before
    clipping."""
    with_grad = [p for p in params if p.grad is not None]
    counted = [p for p in with_grad if not getattr(p, "pipeline_duplicate", False)]
    device = params[0].device
    split_sq, replicated_sq, expert_sq = _squares([(p, p.grad) for p in counted], device)
    pieces = sharded.pieces if sharded is not None else []
    if sharded is not None:
        blocks = _squares([(pc.param, pc.grad) for pc in pieces], device)
        dense = torch.stack(blocks[:2])
        comm.all_reduce(dense, ps.dp_cp_group, op=dist.ReduceOp.SUM)
        if any(is_expert(b.params[0]) for b in sharded.buckets):
            comm.all_reduce(blocks[2], ps.edp_group, op=dist.ReduceOp.SUM)
        split_sq, replicated_sq = split_sq + dense[0], replicated_sq + dense[1]
        expert_sq = expert_sq + blocks[2]
    if ps.ep > 1:
        comm.all_reduce(expert_sq, ps.ep_group, op=dist.ReduceOp.SUM)
    split_sq = split_sq + expert_sq
    if ps.tp > 1:
        comm.all_reduce(split_sq, ps.tp_group, op=dist.ReduceOp.SUM)
    total_sq = split_sq + replicated_sq
    if ps.pp > 1:
        comm.all_reduce(total_sq, ps.pp_group, op=dist.ReduceOp.SUM)
    norm = float(total_sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        grads = [p.grad for p in with_grad] + [pc.grad for pc in pieces]
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def _squares(grads: list[tuple[nn.Parameter, torch.Tensor]], device) -> list[torch.Tensor]:
    """The fp64 sums of squares of the tp-split dense, the replicated and the expert gradients
    among grads ((parameter, gradient) pairs)."""
    experts = [g for p, g in grads if is_expert(p)]
    dense = [(p, g) for p, g in grads if not is_expert(p)]
    split = [g for p, g in dense if getattr(p, "tp_split_dim", None) is not None]
    replicated = [g for p, g in dense if getattr(p, "tp_split_dim", None) is None]
    return [_sum_of_squares(kind, device) for kind in (split, replicated, experts)]
