"""Next-token prediction: the cross-entropy of each position's next token, plus, with
multi-token prediction (model.mtp_depth, megatronish.model.mtp), model.mtp_loss_coef times the
mean over the depths of the cross-entropies of the tokens further ahead. The main loss alone is
what the step reports and what evaluation measures (the modules run in training only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.config import Config
from megatronish.distributed.layout import ParallelState
from megatronish.objectives.batch import MicroBatch
from megatronish.objectives.cross_entropy import mean_cross_entropy
from megatronish.objectives.interface import Losses, Objective

if TYPE_CHECKING:
    from megatronish.model import GPT


class NextToken(Objective):
    """Next-token cross-entropy, with the multi-token prediction loss where the model has its
    modules and is training."""

    name = "next_token"

    def __init__(self, cfg: Config, ps: ParallelState):
        self.ps, self.backend = ps, cfg.kernels.backend
        self.mtp_loss_coef = cfg.model.mtp_loss_coef

    def losses(self, model: GPT, hidden: torch.Tensor, micro: MicroBatch) -> Losses:
        divisor = micro.divisor
        main_divisor = divisor if divisor is None or divisor.dim() == 0 else divisor[0]
        normed, logits = model.head(hidden)
        main = self.cross_entropy(logits, micro.targets, main_divisor)
        if model.mtp is None or not model.training:
            return Losses(main, main)
        mtp = self.mtp_loss(model, normed, micro)
        return Losses(main, main + self.mtp_loss_coef * mtp, mtp)

    def cross_entropy(
        self, logits: torch.Tensor, targets: torch.Tensor, divisor: torch.Tensor | None
    ) -> torch.Tensor:
        """objectives.cross_entropy.mean_cross_entropy on this run's layout and kernels."""
        return mean_cross_entropy(logits, targets, divisor, self.ps, self.backend)

    def mtp_loss(self, model: GPT, normed: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        """The mean over the depths of their cross-entropies, from the main model's output
        after its final norm [b, s, h]."""
        if micro.future_tokens is None:
            raise RuntimeError("multi-token prediction needs the tokens ahead (future_tokens)")
        tokens, targets = micro.future_tokens[:, 0], micro.future_tokens[:, 1]  # [b, D, s]
        depths = model.mtp_hidden(normed, tokens, micro.documents)
        losses = []
        for k, x in enumerate(depths, start=1):
            divisor = None if micro.divisor is None else micro.divisor[k]
            losses.append(self.cross_entropy(model.logits(x), targets[:, k - 1], divisor))
        return torch.stack(losses).mean()
