"""Routing: router logits -> each token's top_k experts and their combine weights, and the two
router losses.

Shapes: T tokens, E experts, k top_k. The router is fp32 (autocast off; float64 on float64
inputs): its logits, the softmax and the top-k are computed the same way at every precision,
so routing decisions do not flip with bf16 rounding.

Losses, over the T_all tokens of one micro-batch (all the cp ranks' shares of its sequences):
- load balancing (Switch Transformer eq. 4): E x sum_i f_i P_i, f_i the fraction of the
  T_all x k routed assignments that chose expert i, P_i the mean router probability of expert
  i; 1 at perfect balance. Only P carries a gradient.
- z-loss (ST-MoE eq. 5): the mean over tokens of logsumexp(logits)^2.
- sequence-wise balancing (DeepSeek-V3 eq. 17-20): per sequence of s tokens, sum_i f_i P_i,
  f_i = E / (k s) x the sequence's assignments to expert i, P_i the sequence's mean of the
  scores normalized over all experts; the mean over the micro-batch's sequences.
Each rank computes its share (its tokens' probabilities and logits over T_all; the counts f
are summed over the cp group, and over tp under sequence parallelism, first), so the shares
of a micro-batch add up to its loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routing:
    experts: torch.Tensor  # [T, k] int64: the chosen experts of each token, best first
    weights: torch.Tensor  # [T, k] fp32: their combine weights (differentiable)
    probs: torch.Tensor  # [T, E] fp32: softmax over all experts (the balancing loss's P)
    logits: torch.Tensor  # [T, E] fp32


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, h] times the router weight [E, h] (plus the logits' bias [E], GPT-OSS's), in fp32
    (float64 for float64 inputs) -> [T, E]."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


@dataclass(frozen=True)
class Grouping:
    """The sigmoid router's settings: n_group groups of which a token may use topk_group, and
    the combine weights' factor."""

    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0


def route(
    logits: torch.Tensor,
    top_k: int,
    kind: str,
    bias: torch.Tensor | None = None,
    grouping: Grouping = Grouping(),
    forced: torch.Tensor | None = None,
) -> Routing:
    """softmax_topk: softmax over all experts, keep the top_k, renormalize them to sum 1
    (Mixtral). topk_softmax: the top_k logits, softmax over those. sigmoid: see
    sigmoid_route (bias [E], the routing bias). forced [T, k] (routing replay): each token's
    experts where its row is >= 0, their weights computed from the scores as for a choice."""
    routing = _route(logits, top_k, kind, bias, grouping)
    if forced is None:
        return routing
    experts = torch.where(forced[:, :1] >= 0, forced, routing.experts)
    if kind == "sigmoid":
        weights = torch.sigmoid(logits).gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * grouping.scale
    elif kind == "softmax_topk":
        weights = routing.probs.gather(1, experts)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        weights = torch.softmax(logits.gather(1, experts), dim=-1)
    return Routing(experts, weights, routing.probs, logits)


def _route(
    logits: torch.Tensor, top_k: int, kind: str, bias: torch.Tensor | None, grouping: Grouping
) -> Routing:
    if kind == "sigmoid":
        assert bias is not None, "the sigmoid router needs its bias"
        return sigmoid_route(logits, top_k, bias, grouping)
    probs = torch.softmax(logits, dim=-1)
    if kind == "softmax_topk":
        weights, experts = probs.topk(top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    elif kind == "topk_softmax":
        values, experts = logits.topk(top_k, dim=-1)
        weights = torch.softmax(values, dim=-1)
    else:
        raise ValueError(f"router must be softmax_topk, topk_softmax or sigmoid, got {kind!r}")
    return Routing(experts, weights, probs, logits)


def sigmoid_route(
    logits: torch.Tensor, top_k: int, bias: torch.Tensor, grouping: Grouping
) -> Routing:
    """DeepSeek-V3: scores s = sigmoid(logits); the experts are the top_k of s + bias among
    the experts of each token's topk_group best groups (a group ranked by the sum of its two
    best biased scores); their weights the unbiased scores over their sum (+ 1e-20) times
    grouping.scale. The bias only chooses: no gradient flows through it. probs (for the
    balancing losses): s normalized over all experts."""
    scores = torch.sigmoid(logits)
    choice = scores.detach() + bias.to(scores.dtype)
    tokens, num_experts = choice.shape
    if grouping.n_group > 1:
        groups = choice.view(tokens, grouping.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best = group_scores.topk(grouping.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        allowed = allowed[:, :, None].expand_as(groups).reshape(tokens, num_experts)
        choice = choice.masked_fill(~allowed, float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * grouping.scale
    probs = scores / scores.sum(dim=-1, keepdim=True)
    return Routing(experts, weights, probs, logits)


def balancing_loss_share(
    probs: torch.Tensor, counts: torch.Tensor, tokens: int, top_k: int
) -> torch.Tensor:
    """This rank's share of the load-balancing loss: probs [T, E] of its tokens, counts [E]
    the routed assignments of the whole micro-batch per expert, tokens = T_all."""
    num_experts = probs.shape[-1]
    fraction = counts.to(probs.dtype) / (tokens * top_k)  # f_i
    return num_experts * (fraction * probs.sum(dim=0)).sum() / tokens


def sequence_loss_share(
    probs: torch.Tensor, counts: torch.Tensor, seq_len: int, top_k: int
) -> torch.Tensor:
    """This rank's share of DeepSeek-V3's sequence-wise balancing loss, averaged over the b
    sequences: probs [b, s, E] of its tokens (s: its share of each sequence), counts [b, E] the
    routed assignments of each whole sequence of seq_len tokens per expert."""
    num_experts = probs.shape[-1]
    fraction = counts.to(probs.dtype) * (num_experts / (top_k * seq_len))  # f_i per sequence
    share = probs.sum(dim=1) / seq_len  # this rank's part of P_i per sequence
    return (fraction * share).sum() / probs.shape[0]


def z_loss_share(logits: torch.Tensor, tokens: int) -> torch.Tensor:
    """This rank's share of the router z-loss: sum over its tokens of logsumexp^2 / T_all."""
    return torch.logsumexp(logits, dim=-1).square().sum() / tokens
