"""What the step loop, the pipeline's last stage and evaluation ask of an objective: the
losses of one micro-batch from the final hidden states of the model's last stage. One module
per objective implements it (objectives.next_token); objectives.registry finds it by name.

An objective reads the model through what it gives: `head` (final norm and logits), `logits`,
and `mtp_hidden` (the multi-token prediction modules' hidden states). The router losses of
mixture-of-experts layers are not an objective's: each layer adds its own in backward
(megatronish.moe.layer), on whichever pipeline stage holds it, whatever the objective.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from megatronish.objectives.batch import MicroBatch

if TYPE_CHECKING:
    from megatronish.model import GPT


@dataclass(frozen=True)
class Losses:
    """One micro-batch's losses."""

    main: torch.Tensor
    """What is reported: the step's loss and the validation loss are means of it."""
    total: torch.Tensor
    """What backward differentiates (scaled by the step loop for accumulation)."""
    mtp: torch.Tensor | None = None
    """The mean over the depths of the multi-token prediction losses (None without them or
    outside training); reported beside the loss."""


class Objective(ABC):
    """One training objective; built for a run (its config and layout), stateless after."""

    name: ClassVar[str]

    @abstractmethod
    def losses(self, model: GPT, hidden: torch.Tensor, micro: MicroBatch) -> Losses:
        """The losses of `micro` from the last stage's final hidden states [b, s, h] (the
        output of the model's last chunk, before the final norm)."""

    def __call__(self, model: GPT, micro: MicroBatch) -> Losses:
        """The losses of `micro` through a model of one pipeline stage."""
        return self.losses(model, model.stage_forward(micro.tokens, micro.documents), micro)
