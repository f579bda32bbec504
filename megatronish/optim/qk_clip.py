"""QK-clip (MuonClip, Kimi K2's paper), optim.muon.qk_clip_tau: after each applied optimizer
step, every attention head whose largest pre-softmax logit over the step's tokens (model.
logit_max: q.k times the softmax scale before any soft-cap, masked pairs left out, every
micro-batch) exceeded tau has its query and key weights scaled so that its logits shrink by
gamma = tau / max:

  multi-head attention: head i's query rows by sqrt(gamma_i); a key head shared by a group of
  query heads (GQA) by sqrt(min gamma over the group), the factor of the group's largest
  logit (as for the one key of MLA and MHA): head i's logits shrink by sqrt(gamma_i
  gamma_group) <= gamma_i, so its largest ends at or below tau, and no weight ever grows;
  MLA: each head's non-rope query rows and its non-rope key rows (in kv_b) by sqrt(gamma_i),
  its rope query rows by gamma_i, the shared rope key (kv_a, every head's) not at all.

Biases (model.qkv_bias) are left alone, as MuonClip defines the clip on W_q and W_k.

Layouts: a head's logits are spread over the dp x cp ranks (their tokens and, under cp, their
queries) and over the micro-batches: its maximum is reduced (MAX, one all-reduce of every
layer's heads, counted) over the dp x cp group; tp ranks hold other heads and pp stages other
layers. The weights are whole on every dp rank after the step (Muon's matrices stay out of the
ZeRO buckets, owned whole and broadcast), so every rank scales its own copy the same way: each
tp rank its heads' rows, fused qkv per key-value group. The clip keeps no state: a checkpoint
saves nothing for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatronish.config import Config
from megatronish.config.optim_checks import muon_settings
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.model.mla import LatentAttention


class QKClip:
    """The clip of a model's attention layers on this rank (none when qk_clip_tau is null)."""

    def __init__(self, model: nn.Module, cfg: Config, ps: ParallelState):
        self.tau = muon_settings(cfg).qk_clip_tau if cfg.optim.name == "muon" else None
        self.ps = ps
        self.layers = [m for m in model.modules() if getattr(m, "logit_max", None) is not None]
        self.last: torch.Tensor | None = None  # this rank's heads' largest logit, last step

    @torch.no_grad()
    def after_step(self, applied: bool) -> None:
        """Clips the heads over tau after a step (applied: its update was not skipped) and
        starts the next step's record; every rank of the dp x cp group calls it."""
        maxima = [layer.logit_max.take() for layer in self.layers]
        if not applied or not self.layers:
            return
        flat = torch.cat(maxima)  # every layer's heads on this rank
        if self.ps.dp_cp > 1:
            comm.all_reduce(flat, self.ps.dp_cp_group, op=dist.ReduceOp.MAX)
        self.last = flat.max()
        for layer, heads in zip(self.layers, flat.split([m.numel() for m in maxima])):
            gamma = torch.where(heads > self.tau, self.tau / heads, torch.ones_like(heads))
            if isinstance(layer, LatentAttention):
                scale_latent_heads(layer, gamma)
            else:
                scale_fused_heads(layer, gamma)

    def metrics(self) -> dict:
        """{"max_attn_logit": the last step's largest logit over every head and layer} (empty
        when the clip is off); every rank calls it (reduced over the tp and pp groups)."""
        if self.tau is None or self.last is None:
            return {}
        value = self.last.clone()
        for size, group in ((self.ps.tp, self.ps.tp_group), (self.ps.pp, self.ps.pp_group)):
            if size > 1:
                comm.all_reduce(value, group, op=dist.ReduceOp.MAX)
        return {"max_attn_logit": float(value)}


def scale_fused_heads(attention: nn.Module, gamma: torch.Tensor) -> None:
    """The fused qkv weight's rows of this rank's heads (per key-value group: its query heads,
    their gates if any, its key, its value): query head i's by sqrt(gamma[i]), the group's key
    by sqrt(min gamma over its query heads); gamma [n/t]."""
    weight = attention.qkv.weight
    groups, per_group, d = attention.local_groups, attention.heads_per_group, attention.head_dim
    units = weight.view(groups, weight.shape[0] // groups, weight.shape[1])  # per kv group
    root = gamma.sqrt().view(groups, per_group)
    queries = units[:, : per_group * d].view(groups, per_group, d, -1)
    queries.mul_(root[:, :, None, None].to(weight.dtype))
    key = units[:, -2 * d : -d]
    key.mul_(root.amin(dim=1)[:, None, None].to(weight.dtype))


def scale_latent_heads(attention: LatentAttention, gamma: torch.Tensor) -> None:
    """MLA's split: head i's non-rope query and key rows by sqrt(gamma[i]), its rope query rows
    by gamma[i]; gamma [n/t]."""
    nope, heads = attention.nope, attention.local_heads
    query = attention.q if attention.q_rank is None else attention.q_b
    q_rows = query.weight.view(heads, -1, query.weight.shape[1])  # [n/t, e + p, in]
    kv_rows = attention.kv_b.weight.view(heads, -1, attention.kv_b.weight.shape[1])  # e + v
    root = gamma.sqrt()[:, None, None].to(q_rows.dtype)
    q_rows[:, :nope].mul_(root)
    q_rows[:, nope:].mul_(gamma[:, None, None].to(q_rows.dtype))
    kv_rows[:, :nope].mul_(root)
