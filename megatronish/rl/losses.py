"""The policy-gradient losses of RL post-training, as trl's GRPOTrainer computes them
(`_compute_loss`), on the flat completion tokens of packed sequences.

Legend: T the tokens of a row (this cp rank's shard), i a sequence, m_t 1 on its completion
tokens (positions >= prompt_len) else 0, n_i = max(sum_t m_t, 1), N the sequences of the step,
A_i the advantage, r the importance ratio, eps_l / eps_h the clip range:

    per token  l_t = -min(r A_i, clip(r, 1 - eps_l, 1 + eps_h) A_i) + beta k3_t
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1           (when beta = kl_coef > 0)
    r = exp(logp_t - old_t)                                      grpo, dr_grpo, dapo
    r = exp(sum_t m_t (logp_t - old_t) / n_i)  for every t of i  gspo (the sequence's ratio)

    grpo, gspo   loss = 1/N sum_i 1/n_i sum_t m_t l_t     (each sequence's mean, then their mean)
    dr_grpo      loss = 1/(N L) sum_i sum_t m_t l_t       (L: the longest completion allowed)
    dapo         loss = 1/(sum_i n_i) sum_i sum_t m_t l_t (every completion token of the step)

Each normalizer is known before the forward, so the loss is a weighted sum over tokens:
micro-batches and cp shards add up to it. gspo's sequence sums span cp ranks: one all-reduce
over cp (and its gradient's, backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.errors import UserError
from megatronish.layers.mappings import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")


@dataclass(frozen=True)
class LossSettings:
    """One step's loss: its kind (LOSSES), clip range and KL coefficient."""

    kind: str
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0

    def __post_init__(self):
        if self.kind not in LOSSES:
            raise UserError(f"loss: {self.kind!r} is not valid; must be one of {', '.join(LOSSES)}")


@dataclass(frozen=True)
class TokenTerms:
    """What the loss of a row's tokens [T] takes besides their log-probabilities."""

    advantages: torch.Tensor
    """A_i at each token of sequence i (fp32)."""
    weights: torch.Tensor
    """m_t times the loss's normalizer of the token's sequence (sequence_weights; fp32)."""
    shares: torch.Tensor
    """m_t / sum_i n_i: a token's share in the step's token means (KL, entropy; fp32)."""
    segments: torch.Tensor
    """The index of each token's sequence in the row (int64); gspo sums over it."""
    mask: torch.Tensor
    """m_t (fp32)."""
    counts: torch.Tensor
    """n_i of each sequence of the row, in segment order (fp32)."""
    old: torch.Tensor | None = None
    """The log-probabilities the rollouts were sampled with; None: logp itself, detached."""
    ref: torch.Tensor | None = None
    """The reference policy's, for the KL term (None: no KL)."""


def sequence_weights(kind: str, counts: list[int], max_completion: int) -> list[float]:
    """The normalizer of each sequence's token terms: 1/(N n_i) (grpo, gspo), 1/(N L) (dr_grpo,
    L = max_completion), 1/sum n_i (dapo); counts are the n_i before the clamp to 1."""
    n = len(counts)
    if kind in ("grpo", "gspo"):
        return [1.0 / (n * max(count, 1)) for count in counts]
    if kind == "dr_grpo":
        return [1.0 / (n * max_completion)] * n
    return [1.0 / max(sum(counts), 1)] * n


def policy_loss(
    logp: torch.Tensor,
    terms: TokenTerms,
    settings: LossSettings,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this row's share of the loss: sum_t weights_t l_t, fp32 scalar; its shares of the
    step's metrics `clip_fraction`, `kl`, detached). `clip_fraction` counts a token whose ratio
    is clipped against its advantage's sign, as trl's clip_ratio/region_mean does; gspo counts
    each sequence once."""
    old = logp.detach() if terms.old is None else terms.old
    log_ratio = logp - old
    if settings.kind == "gspo":
        sums = torch.zeros(len(terms.counts), dtype=logp.dtype, device=logp.device)
        sums = sums.index_add(0, terms.segments, log_ratio * terms.mask)
        if cp_group is not None:  # a sequence's tokens on every cp rank
            sums = reduce_from_tensor_parallel_region(
                copy_to_tensor_parallel_region(sums, cp_group), cp_group
            )
        log_ratio = (sums / terms.counts.clamp(min=1.0))[terms.segments]
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - settings.clip_low, 1 + settings.clip_high)
    adv = terms.advantages
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    metrics = {}
    if settings.kl_coef != 0.0:
        if terms.ref is None:
            raise UserError("ref_logprobs: needed when kl_coef is not 0")
        diff = terms.ref - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + settings.kl_coef * kl
        metrics["kl"] = (kl.detach() * terms.shares).sum()
    clipped = ((ratio < 1 - settings.clip_low) & (adv < 0)) | (
        (ratio > 1 + settings.clip_high) & (adv > 0)
    )
    # gspo counts sequences: its weights, m_t / (N n_i), give each sequence's tokens 1/N
    share = terms.weights if settings.kind == "gspo" else terms.shares
    metrics["clip_fraction"] = (clipped.detach().float() * share).sum()
    return (per_token * terms.weights).sum(), metrics
