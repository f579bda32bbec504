"""Direct Preference Optimization (train.objective dpo; Rafailov et al. 2023), with the losses
of trl's DPOTrainer: each row of a micro-batch is a pair (data.pairs), its chosen conversation
document 0 and its rejected one document 1; a response's log-probability is the sum of its
counted targets' log-probabilities (the vocab-parallel ones of layers.token_stats).

With margin = (logp_c - ref_c) - (logp_r - ref_r), the reference log-probabilities those of the
initial weights (micro.reference, computed once per pair: training.preference):
  sigmoid: -(1 - ls) log sigmoid(beta * margin) - ls log sigmoid(-beta * margin)
  ipo:     (margin' - 1 / (2 beta))^2, margin' of the log-ratios divided by each response's
           token count (trl's IPO)
averaged over the micro-batch's pairs: the step loop and the data-parallel reduction then
average over the global batch's pairs. Under cp each rank holds a shard of every row: the
sums are all-reduced over the cp group (backward: each rank's own part), and the loss scaled
by cp for the gradient reduction's mean over dp x cp.

Shapes: b pairs, s this cp rank's shard of the rows, V / t this tp rank's vocab shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megatronish.config import Config
from megatronish.config.objective_checks import dpo_settings
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.layers.token_stats import token_logprobs
from megatronish.objectives.batch import MicroBatch
from megatronish.objectives.interface import Losses, Objective

if TYPE_CHECKING:
    from megatronish.model import GPT

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""What metrics.jsonl logs beside the loss (trl's names): the means over the pairs of
beta * (logp - ref) of each response, their difference, and the share where chosen's is larger."""


class DPO(Objective):
    """The DPO loss of pairs with their reference log-probabilities; without them (the
    reference pass, validation) it keeps each micro-batch's response log-probabilities and
    token counts in `logps`."""

    name = "dpo"

    def __init__(self, cfg: Config, ps: ParallelState):
        self.ps, self.backend = ps, cfg.kernels.backend
        self.settings = dpo_settings(cfg)
        # id(micro) -> [b, 2, 2]: the sums and token counts (the passes without a reference)
        self.logps: dict[int, torch.Tensor] = {}
        self.totals = torch.zeros(len(METRICS), dtype=torch.float64)  # sums of micro means
        self.micro_count = 0

    def losses(self, model: GPT, hidden: torch.Tensor, micro: MicroBatch) -> Losses:
        _, logits = model.head(hidden)  # [b, s, V / t]
        logp = token_logprobs(logits, micro.targets, self.ps.tp_group, self.backend)  # [b, s]
        sums, counts = self.response_sums(logp, micro)  # [b, 2] each
        if micro.reference is None:
            self.logps[id(micro)] = torch.stack([sums.detach(), counts], -1)
            zero = sums.sum() * 0.0
            return Losses(zero.detach(), zero)
        ratios = sums - micro.reference.to(sums.device)  # [b, 2]: logp - ref
        loss = self.pair_losses(ratios, counts).mean()
        stats = self.reward_stats(ratios.detach())
        self.totals = self.totals.to(stats.device) + stats.double()  # no sync with the device
        self.micro_count += 1
        return Losses(loss.detach(), loss * self.ps.cp)

    def pair_losses(self, ratios: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each pair's loss [b] from its log-ratios and response token counts [b, 2]."""
        beta, smoothing = self.settings.beta, self.settings.label_smoothing
        if self.settings.loss == "ipo":
            averaged = ratios / counts.clamp(min=1)
            return (averaged[:, 0] - averaged[:, 1] - 1 / (2 * beta)) ** 2
        margin = ratios[:, 0] - ratios[:, 1]
        return (
            -F.logsigmoid(beta * margin) * (1 - smoothing)
            - F.logsigmoid(-beta * margin) * smoothing
        )

    def reward_stats(self, ratios: torch.Tensor) -> torch.Tensor:
        """The means of METRICS [4] over pairs of log-ratios [b, 2]."""
        rewards = self.settings.beta * ratios
        margins = rewards[:, 0] - rewards[:, 1]
        return torch.stack([*rewards.mean(0), margins.mean(), (margins > 0).float().mean()])

    def response_sums(
        self, logp: torch.Tensor, micro: MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sums of the chosen and rejected responses' token log-probabilities [b, 2],
        differentiable, their token counts [b, 2]) over the whole rows: one all-reduce over
        the cp group under cp."""
        if micro.documents is None:
            raise RuntimeError("DPO needs the pairs' documents (data.document_mask)")
        counted = micro.targets != -100
        sides = torch.stack([counted & (micro.documents.segments == k) for k in (0, 1)], 1)
        local = torch.stack([(logp.unsqueeze(1) * sides).sum(-1), sides.sum(-1).float()], 0)
        if self.ps.cp == 1:
            return local[0], local[1]
        whole = local.detach().clone()
        comm.all_reduce(whole, self.ps.cp_group)
        whole = local + (whole - local.detach())  # the whole rows' sums; backward: this shard's
        return whole[0], whole[1]

    def take_metrics(self) -> torch.Tensor:
        """The means of METRICS over the micro-batches since the last call (this rank's)."""
        means = self.totals / max(self.micro_count, 1)
        self.totals.zero_()
        self.micro_count = 0
        return means
