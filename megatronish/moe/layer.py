"""The mixture-of-experts MLP of one block: router -> dispatch -> grouped expert SwiGLU ->
combine (plus the shared experts' MLP, if any, under its sigmoid gate where model.moe has one),
with its router losses attached to the backward.

Shapes: b batch, s sequence, h d_model, T = b s tokens of this rank, E experts, k top_k.

Layout: the tokens are replicated over the tp ranks; every tp rank routes them identically
and dispatches them over its own ep group, and each expert's FFN is column/row-parallel over
tp like the dense MLP: the dispatched tokens and the combine weights enter the tp region
through f (identity forward, all-reduce backward) and the combined output leaves through g
(all-reduce forward). Under sequence parallelism a tp rank routes its own s / t tokens (the
router weight's gradient is then summed over tp, as a norm's); the tokens, their combine
weights and their experts are all-gathered over tp (reduce-scatter backward) and the output
reduce-scattered, as the dense MLP does. Routing depends only on a token's hidden state, so it
is the same at every tp, ep, cp and pp, with or without sequence parallelism.

Router losses: each layer adds (aux_loss_coef x load balancing + z_loss_coef x z-loss +
seq_aux_loss_coef x sequence-wise balancing) / (MoE layers) of its micro-batch to the loss,
attached to the layer's output (AttachLoss: the forward is the identity, the backward also
starts the loss's gradient), so it reaches the backward from any pipeline stage. Under cp a
rank's share is scaled by cp, as the cross-entropy loss is, so the gradient mean over the
dp x cp group is the micro-batches' mean.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.config import Derived, ModelConfig
from megatronish.context.documents import Documents
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.layers import mappings
from megatronish.layers.linear import mark_parallel, to_autocast_dtype
from megatronish.layers.plan import LinearPlan
from megatronish.layers.roles import set_role
from megatronish.moe import replay
from megatronish.moe.adapters import expert_adapters
from megatronish.moe.dispatch import capacity_keep, capacity_of, combine, dispatch, make_plan
from megatronish.moe.experts import GroupedExperts
from megatronish.moe.router import (
    Grouping,
    balancing_loss_share,
    route,
    router_logits,
    sequence_loss_share,
    z_loss_share,
)
from megatronish.moe.stats import LayerStats


class AttachLoss(torch.autograd.Function):
    """y = x; backward also gives `loss` (a scalar) the gradient `scale`, so the loss joins
    the backward pass wherever x's gradient flows."""

    @staticmethod
    def forward(ctx, x, loss, scale: float):
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full(ctx.loss_shape, ctx.scale, dtype=torch.float32), None


class Router(nn.Module):
    """The router weight [E, h], replicated over tp; with the sigmoid router also its routing
    bias [E] (fp32, replicated everywhere): model state that checkpoints store, moved by
    moe.balance after each step, never by the optimizer (requires_grad False). With
    logit_bias (GPT-OSS) a trained bias [E] added to the logits, replicated over tp."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        biased: bool = False,
        logit_bias: bool = False,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        mark_parallel(self.weight, None, (num_experts, d_model))
        self.logit_bias = None
        if logit_bias:  # initialized as the weight: normal(0, 0.02), as transformers does
            self.logit_bias = nn.Parameter(torch.empty(num_experts))
            mark_parallel(self.logit_bias, None, (num_experts,))
        # Under sequence parallelism each tp rank's gradient covers its own tokens.
        for param in (self.weight, self.logit_bias):
            if param is not None:
                set_role(param, sequence_parallel_grad=sequence_parallel)
        self.bias = None
        if biased:
            self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
            mark_parallel(self.bias, None, (num_experts,))


class SharedGate(nn.Module):
    """The shared experts' gate: weight [1, h], replicated over tp; sigmoid(x w^T) [b, s, 1]."""

    def __init__(self, d_model: int, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, d_model))
        mark_parallel(self.weight, None, (1, d_model))
        # Under sequence parallelism each tp rank's gradient covers its own tokens.
        set_role(self.weight, sequence_parallel_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight.to(x.dtype)))


class MoELayer(nn.Module):
    def __init__(
        self,
        model: ModelConfig,
        derived: Derived,
        ps: ParallelState,
        experts: LinearPlan,
        backend: str,
        sequence_parallel: bool,
        shared: nn.Module | None = None,
        index: int | None = None,
    ):
        """model: its model.moe and d_model; experts: the routed experts' plan
        (megatronish.layers.plan); sequence_parallel: on at tp > 1 only; shared: the shared
        experts' MLP, if any (a block's plan gives the rest: megatronish.model.plan); index:
        the block's layer index (routing replay's key: moe.replay)."""
        super().__init__()
        self.index, self.tp_rank = index, ps.tp_rank
        self.moe_index = derived.moe_layers.index(index) if index in derived.moe_layers else None
        moe = model.moe
        self.num_experts, self.top_k, self.kind = moe.num_experts, moe.top_k, moe.router
        self.capacity_factor = moe.capacity_factor
        self.aux_coef, self.z_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.loss_weight = 1.0 / len(derived.moe_layers)
        self.ep, self.cp = derived.ep, derived.cp
        self.tp_group, self.ep_group, self.cp_group = ps.tp_group, ps.ep_group, ps.cp_group
        self.sequence_parallel = sequence_parallel
        # The tokens of a micro-batch's sequence shard are split over tp under sequence
        # parallelism: the router losses count every tp rank's share.
        self.token_shards = self.cp * (derived.tp if self.sequence_parallel else 1)
        local = moe.num_experts // derived.ep
        parts = model.components
        self.router = Router(
            moe.num_experts,
            model.d_model,
            moe.router == "sigmoid",
            parts.biased_experts,
            self.sequence_parallel,
        )
        self.grouping = Grouping(moe.n_group, moe.topk_group, moe.routed_scaling_factor)
        self.seq_coef = moe.seq_aux_loss_coef
        # Routed assignments per expert since the last bias update (moe.balance), this rank's.
        self.load = torch.zeros(moe.num_experts, dtype=torch.int64)
        self.experts = GroupedExperts(
            local,
            ps.ep_rank * local,
            model.d_model,
            derived.moe_d_ff,
            derived.tp,
            backend,
            ps.tp_group,
            experts,
            model.activation_limit,
            parts.biased_experts,
            expert_adapters(model.lora, local, ps.ep_rank * local, model.d_model, derived),
        )
        self.shared = shared
        gated = shared is not None and moe.shared_expert_gate
        self.shared_gate = SharedGate(model.d_model, sequence_parallel) if gated else None
        self.loss_scale = 1.0  # the backward's scale of this micro-batch's loss (1 / accum)
        self.stats = LayerStats(moe.num_experts, self.sequence_parallel, self.router.bias)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """x [b, s, h] (replicated over tp; [b, s / t, h] under sequence parallelism) -> the
        same shape; documents: the micro-batch's, whose routes (moe.replay), if any, force
        the experts."""
        b, s, h = x.shape
        router = self.router
        logits = router_logits(x.reshape(b * s, h), router.weight, router.logit_bias)  # [T, E]
        forced = replay.forced(documents, self.moe_index)  # [b, s x (t under SP), k]
        if forced is not None:
            forced = (
                forced[:, self.tp_rank * s : (self.tp_rank + 1) * s]
                if self.sequence_parallel
                else forced
            )
            forced = forced.reshape(b * s, -1).to(logits.device)
        routing = route(logits, self.top_k, self.kind, self.router.bias, self.grouping, forced)
        replay.record(self.index, routing.experts)
        group = self.tp_group
        # In the matmul dtype (bf16 under autocast) before the collectives, as the dense MLP.
        tokens, weights, experts = to_autocast_dtype(x), routing.weights, routing.experts
        # Under sequence parallelism every tp rank's tokens, along the sequence.
        sp = self.sequence_parallel
        tokens = mappings.to_tensor_parallel_region(tokens, group, sp)
        weights = mappings.to_tensor_parallel_region(weights.view(b, s, -1), group, sp)
        if sp:
            experts = mappings.gather_from_sequence_parallel_region(experts.view(b, s, -1), group)
        full = b * tokens.shape[1]
        weights, experts = weights.reshape(full, -1), experts.reshape(full, -1)
        total = experts.shape[0]
        keep = None
        if self.capacity_factor is not None:
            capacity = capacity_of(self.capacity_factor, total, self.top_k, self.num_experts)
            keep = capacity_keep(experts, self.num_experts, capacity)
        plan = make_plan(experts, keep, self.num_experts, self.ep, self.ep_group)
        rows = dispatch(tokens.reshape(total, h), plan, self.ep_group)
        y = self.experts(rows, plan.local_offsets, plan.source_counts)  # [R, h], partial over tp
        out = combine(y, plan, weights, total, self.ep_group).view(b, -1, h)
        if self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, group)
        else:
            out = mappings.reduce_from_tensor_parallel_region(out, group)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else self.shared_gate(x) * shared)
        if not (self.training and torch.is_grad_enabled()):
            return out
        loss, balance, z, counts = self.router_loss(routing, b)
        if not _RECOMPUTING[0]:
            self.stats.add(counts, keep, balance, z)
            self.load = (
                self.load.to(counts.device) + counts
            )  # keep: the whole (gathered) micro-batch
        if loss.requires_grad:
            out = AttachLoss.apply(out, loss, self.loss_scale)
        return out

    def router_loss(
        self, routing, b: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's share of the micro-batch's router loss term (differentiable), its
        shares of the balancing and z-losses (unweighted, detached: for the metrics), and its
        routed assignments per expert [E]. b: the sequences of the micro-batch."""
        experts = routing.experts.view(b, -1)  # [b, s k] of this rank's tokens
        per_sequence = torch.zeros(b, self.num_experts, dtype=torch.int64, device=experts.device)
        per_sequence.scatter_add_(1, experts, torch.ones_like(experts))
        counts = per_sequence.sum(0)
        tokens = routing.logits.shape[0] * self.token_shards
        if self.token_shards > 1:  # f counts the whole micro-batch's (sequences') assignments
            whole = per_sequence.clone() if self.seq_coef else counts.clone()
            if self.sequence_parallel:
                comm.all_reduce(whole, self.tp_group)
            if self.cp > 1:
                comm.all_reduce(whole, self.cp_group)
            per_sequence = whole if self.seq_coef else per_sequence
            all_counts = whole.sum(0) if self.seq_coef else whole
        else:
            all_counts = counts
        balance = balancing_loss_share(routing.probs, all_counts, tokens, self.top_k)
        z = z_loss_share(routing.logits, tokens)
        loss = self.aux_coef * balance + self.z_coef * z
        if self.seq_coef:
            probs = routing.probs.view(b, -1, self.num_experts)
            seq_len = tokens // b
            loss = loss + self.seq_coef * sequence_loss_share(
                probs, per_sequence, seq_len, self.top_k
            )
        # Under cp the loss's gradients are averaged over the cp ranks (scaled back here);
        # under sequence parallelism the router's are summed over tp (no scale).
        loss = loss * (self.cp * self.loss_weight)
        return loss, balance.detach(), z.detach(), counts


_RECOMPUTING = [False]


@contextlib.contextmanager
def recomputing():
    """Marks an activation-checkpointing recompute: MoE layers route again (the same way) but
    do not count the micro-batch a second time in their stats."""
    _RECOMPUTING[0] = True
    try:
        yield
    finally:
        _RECOMPUTING[0] = False
