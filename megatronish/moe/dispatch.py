"""Token dispatch and combine: each token's routed copies, sorted by expert, sent to the ep rank
that holds the expert (all-to-all with per-expert counts), and the experts' outputs sent back
and summed into the tokens with their combine weights.

Shapes: T tokens, h hidden, k top_k, E experts over ep ranks (E_l = E / ep each, contiguous
blocks of global ids: rank j holds j E_l .. (j + 1) E_l - 1). An assignment is a (token, slot)
pair, flat index t k + slot. A: the assignments this rank routes (all T k, less the dropped
ones); R: the rows it receives.

Rows received arrive grouped by source rank, then by expert; they are reordered to
expert-major (one contiguous run of rows per local expert, for the grouped GEMM) and back.
Within an expert's run the rows stay by source rank, each source's in its own order: the
per-(expert, source) counts give fp8's groups of rows (megatronish.fp8.grouped).
Empty experts and ranks that receive nothing are ordinary zero-size splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.distributed import comm


def capacity_of(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """ceil(capacity_factor x tokens x top_k / num_experts): an expert's share of a rank's
    routed assignments."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments of experts [T, k] fit their expert's capacity -> keep [T, k] bool.
    Priority: every token's first choice (in token order), then every second choice, ..."""
    tokens, top_k = experts.shape
    by_priority = experts.t().reshape(-1)  # [k T], index slot * T + token
    order = torch.argsort(by_priority, stable=True)
    counts = torch.bincount(by_priority, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(by_priority.numel(), device=experts.device)
    position = position - starts[by_priority[order]]  # rank within its expert, by priority
    keep = torch.empty_like(by_priority, dtype=torch.bool)
    keep[order] = position < capacity
    return keep.view(top_k, tokens).t()


@dataclass
class DispatchPlan:
    """Where every kept assignment goes (computed without autograd)."""

    token_of: torch.Tensor  # [A] the token of each sent row (rows sorted by global expert)
    slot_of: torch.Tensor  # [A] its flat assignment index t k + slot (for its weight)
    send_splits: list[int]  # rows to each ep rank
    recv_splits: list[int]  # rows from each ep rank
    local_counts: torch.Tensor  # [E_l] rows each local expert receives, over all sources
    source_counts: torch.Tensor  # [E_l, S] of those, the rows from each source (ep) rank
    to_expert_major: torch.Tensor | None  # [R] received rows -> expert-major order (ep > 1)
    to_source_major: torch.Tensor | None  # [R] its inverse

    @property
    def local_offsets(self) -> torch.Tensor:
        """Cumulative end row of each local expert in the expert-major rows (grouped GEMM)."""
        return torch.cumsum(self.local_counts, 0).to(torch.int32)


@torch.no_grad()
def make_plan(
    experts: torch.Tensor,
    keep: torch.Tensor | None,
    num_experts: int,
    ep: int,
    ep_group: dist.ProcessGroup | None,
) -> DispatchPlan:
    """The dispatch of experts [T, k] (keep [T, k]: None keeps all). At ep > 1 the ep ranks
    exchange their per-expert counts (every rank of the ep group calls this together)."""
    flat = experts.reshape(-1)
    slots = torch.arange(flat.numel(), device=flat.device)
    if keep is not None:
        slots = slots[keep.reshape(-1)]
    order = torch.argsort(flat[slots], stable=True)
    slots = slots[order]
    counts = torch.bincount(flat[slots], minlength=num_experts)
    top_k = experts.shape[1]
    token_of = torch.div(slots, top_k, rounding_mode="floor")
    local = num_experts // ep
    if ep == 1:
        total = [slots.numel()]
        return DispatchPlan(token_of, slots, total, total, counts, counts[:, None], None, None)
    received = torch.empty_like(counts)
    comm.all_to_all(received, counts, [local] * ep, [local] * ep, ep_group)
    received = received.view(ep, local)  # [source rank, local expert]
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    sizes = received.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view(ep, local)
    sizes_em, starts_em = received.t().reshape(-1), starts.t().reshape(-1)  # expert-major
    run_base = torch.cumsum(sizes_em, 0) - sizes_em
    rows = int(sizes.sum())
    offsets = torch.repeat_interleave(starts_em - run_base, sizes_em, output_size=rows)
    to_expert_major = offsets + torch.arange(rows, device=counts.device)
    to_source_major = torch.argsort(to_expert_major)
    return DispatchPlan(
        token_of,
        slots,
        send_splits,
        recv_splits,
        received.sum(0),
        received.t(),
        to_expert_major,
        to_source_major,
    )


class _AllToAll(torch.autograd.Function):
    """all_to_all with split sizes; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all(out, x, out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


def dispatch(x: torch.Tensor, plan: DispatchPlan, ep_group) -> torch.Tensor:
    """x [T, h] -> the rows of this rank's local experts [R, h], expert-major."""
    rows = x[plan.token_of]  # [A, h], sorted by global expert
    if plan.to_expert_major is None:
        return rows
    rows = _AllToAll.apply(rows, plan.recv_splits, plan.send_splits, ep_group)
    return rows[plan.to_expert_major]


def combine(
    y: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor, tokens: int, ep_group
) -> torch.Tensor:
    """The experts' outputs y [R, h] (expert-major) back to their tokens: [T, h], each token
    the sum of its kept assignments' outputs times their weights (weights [T, k]); a token
    with no kept assignment gets zeros."""
    if plan.to_source_major is not None:
        y = _AllToAll.apply(y[plan.to_source_major], plan.send_splits, plan.recv_splits, ep_group)
    scale = weights.reshape(-1)[plan.slot_of].to(y.dtype)
    out = y.new_zeros((tokens, y.shape[1]))
    return out.index_add(0, plan.token_of, y * scale[:, None])
