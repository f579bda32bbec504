"""The RL backend's objective: on the last stage, each packed micro-batch's per-token
log-probabilities and entropies from the vocab-parallel logits (layers.token_stats), kept for the
caller, and, when the step gave the micro-batch its loss terms, its share of the
policy-gradient loss (rl.losses) as what backward differentiates.

The pipeline and the single-stage loop call it on MicroBatch objects; a micro-batch's terms
and results are keyed by the object itself, so the schedule's order does not matter.
Shapes: s this cp rank's shard of a packed row, V / t this tp rank's vocab shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.distributed.layout import ParallelState
from megatronish.layers.token_stats import token_entropies, token_logprobs
from megatronish.objectives.batch import MicroBatch
from megatronish.objectives.interface import Losses, Objective
from megatronish.rl.losses import LossSettings, TokenTerms, policy_loss

if TYPE_CHECKING:
    from megatronish.model import GPT


class PolicyObjective(Objective):
    """Log-probabilities and entropies of every micro-batch; the policy-gradient loss of those
    given terms (`terms`), scaled by `scale` for backward."""

    name = "policy_gradient"

    def __init__(self, ps: ParallelState, backend: str, settings: LossSettings | None = None):
        self.ps, self.backend, self.settings = ps, backend, settings
        # the gradient reduction averages over dp x cp what are parts of one sum
        self.scale = float(ps.dp_cp)
        self.terms: dict[int, TokenTerms] = {}  # id(micro) -> its loss terms
        self.logprobs: dict[int, torch.Tensor] = {}  # id(micro) -> [s] fp32
        self.entropies: dict[int, torch.Tensor] = {}
        self.metrics: dict[int, dict[str, torch.Tensor]] = {}

    def losses(self, model: GPT, hidden: torch.Tensor, micro: MicroBatch) -> Losses:
        _, logits = model.head(hidden)  # [1, s, V / t]
        key = id(micro)
        logp = token_logprobs(logits, micro.targets, self.ps.tp_group, self.backend)[0]
        entropy = token_entropies(logits, self.ps.tp_group)[0]
        self.logprobs[key], self.entropies[key] = logp.detach(), entropy
        terms = self.terms.get(key)
        if terms is None or self.settings is None:  # log-probabilities only
            zero = logp.sum() * 0.0
            return Losses(zero.detach(), zero)
        cp_group = self.ps.cp_group if self.ps.cp > 1 else None
        loss, metrics = policy_loss(logp, terms, self.settings, cp_group)
        metrics["entropy"] = (entropy * terms.shares).sum()
        metrics["loss"] = loss.detach()
        self.metrics[key] = metrics
        return Losses(loss.detach(), loss * self.scale)
