"""AdamW, the learning-rate schedule, gradient reduction and clipping.

Parameters carry tags from megatronish.layers.linear.mark_parallel: tp_split_dim (None for
replicated parameters) and, under sequence parallelism, sequence_parallel_grad.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megatronish import comm
from megatronish.config import Config
from megatronish.moe import is_expert
from megatronish.parallel import ParallelState

BUCKET_BYTES = 25 * 1024 * 1024


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
    """AdamW over the model's parameters, or (optim.zero = 1) over the parameters this rank of
    the dp x cp group owns, followed by a broadcast of each updated parameter from its owner.
    Expert weights are owned within their expert-data-parallel group (the ranks that hold
    the same experts) and broadcast over it."""

    def __init__(self, model: nn.Module, cfg: Config, ps: ParallelState):
        self.cfg, self.ps = cfg, ps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.zero = cfg.optim.zero == 1 and ps.dp_cp > 1
        groups = param_groups(model, cfg.train.weight_decay)
        if self.zero:
            dense = [p for p in self.params if not is_expert(p)]
            experts = [p for p in self.params if is_expert(p)]
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
            groups = [{**g, "params": [p for p in g["params"] if id(p) in owned]} for g in groups]
        self.inner = AdamW(
            groups, lr=cfg.train.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps
        )

    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        if self.zero:
            # The owner's updated values go to every other rank of its group.
            for param, _, owner, group in self.owners:
                comm.broadcast(param.data, owner, group)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None


def reduce_gradients(params: list[nn.Parameter], ps: ParallelState) -> None:
    """Sums the gradients of sequence-parallel replicated parameters over the tp group and
    those of the two copies of tied embeddings over the first and last pipeline stage, then
    averages every gradient over the dp x cp group (the data-parallel group when cp is 1) in
    flat buckets of ~25 MB; expert gradients are summed over their expert-data-parallel group
    and divided by dp x cp."""
    if ps.embedding_group is not None:
        for p in params:
            if getattr(p, "pipeline_tied", False) and p.grad is not None:
                comm.all_reduce(p.grad, ps.embedding_group)
    if ps.tp > 1:
        tagged = [
            p for p in params if getattr(p, "sequence_parallel_grad", False) and p.grad is not None
        ]
        _bucketed_all_reduce([p.grad for p in tagged], ps.tp_group, scale=1.0)
    if ps.dp_cp > 1:
        grads = [p.grad for p in params if p.grad is not None and not is_expert(p)]
        _bucketed_all_reduce(grads, ps.dp_cp_group, scale=1.0 / ps.dp_cp)
        experts = [p.grad for p in params if p.grad is not None and is_expert(p)]
        if ps.edp > 1:
            _bucketed_all_reduce(experts, ps.edp_group, scale=1.0 / ps.dp_cp)
        elif experts:
            torch._foreach_mul_(experts, 1.0 / ps.dp_cp)


def _bucketed_all_reduce(grads: list[torch.Tensor], group, scale: float) -> None:
    bucket: list[torch.Tensor] = []
    size = 0
    handles = []
    for grad in grads:
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= BUCKET_BYTES:
            handles.append(_launch(bucket, group))
            bucket, size = [], 0
    if bucket:
        handles.append(_launch(bucket, group))
    for work, flat, members in handles:
        work.wait()
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for grad in members:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _launch(bucket: list[torch.Tensor], group):
    flat = torch.cat([g.reshape(-1) for g in bucket])
    return comm.all_reduce(flat, group, async_op=True), flat, bucket


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared elements of grads, as an fp64 scalar (per-tensor norms first)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, ps: ParallelState) -> float:
    """Global gradient norm, each parameter counted once: the squares of tp-split gradients
    are summed over the tp group (experts' over the ep group first: each ep rank holds other
    experts), replicated ones are taken once, and the stages' sums are added over the
    pipeline (the last stage's copy of tied embeddings left out). Scales the
    gradients down to max_norm when it is exceeded (max_norm 0: no clipping). Returns the norm
    before clipping."""
    with_grad = [p for p in params if p.grad is not None]
    counted = [p for p in with_grad if not getattr(p, "pipeline_duplicate", False)]
    device = params[0].device
    is_split = [getattr(p, "tp_split_dim", None) is not None for p in counted]
    replicated = [p.grad for p, split in zip(counted, is_split) if not split]
    if ps.ep > 1:
        dense = [p.grad for p, split in zip(counted, is_split) if split and not is_expert(p)]
        expert_sq = _sum_of_squares([p.grad for p in counted if is_expert(p)], device)
        comm.all_reduce(expert_sq, ps.ep_group, op=dist.ReduceOp.SUM)
        split_sq = _sum_of_squares(dense, device) + expert_sq
    else:
        split_sq = _sum_of_squares([p.grad for p, split in zip(counted, is_split) if split], device)
    if ps.tp > 1:
        comm.all_reduce(split_sq, ps.tp_group, op=dist.ReduceOp.SUM)
    total_sq = split_sq + _sum_of_squares(replicated, device)
    if ps.pp > 1:
        comm.all_reduce(total_sq, ps.pp_group, op=dist.ReduceOp.SUM)
    norm = float(total_sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_([p.grad for p in with_grad], max_norm / (norm + 1e-6))
    return norm
