"""The objectives by name (objectives.interface.Objective.name), and the losses of whole
sequences through a one-stage model (tests, benchmarks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatronish.config import Config
from megatronish.distributed.layout import ParallelState
from megatronish.model.mtp import future_tokens_of
from megatronish.objectives.batch import MicroBatch
from megatronish.objectives.dpo import DPO
from megatronish.objectives.interface import Losses, Objective
from megatronish.objectives.next_token import NextToken

if TYPE_CHECKING:
    from megatronish.model import GPT

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (NextToken, DPO)}
TRAIN_OBJECTIVES = {"lm": NextToken.name, "dpo": DPO.name}
"""The objective of each value of train.objective."""


def objective_for(cfg: Config, ps: ParallelState, name: str = NextToken.name) -> Objective:
    """The objective called name, built for cfg's run on ps's layout (default: next-token
    prediction, every run's today); a name not registered is a programming error (KeyError)."""
    return OBJECTIVES[name](cfg, ps)


def train_objective(cfg: Config, ps: ParallelState) -> Objective:
    """The objective train.objective names, built for cfg's run on ps's layout."""
    return objective_for(cfg, ps, TRAIN_OBJECTIVES[cfg.train.objective])


def sequence_losses(
    model: GPT, tokens: torch.Tensor, targets: torch.Tensor, name: str = NextToken.name
) -> Losses:
    """The losses of whole sequences tokens and targets [b, s] through a one-stage model at
    cp 1 (in training, its multi-token prediction modules read the tokens ahead of them)."""
    future_tokens = None
    if model.mtp is not None and model.training:
        if model.ps.cp > 1:
            raise RuntimeError("under cp the tokens ahead come from the whole sequences")
        future_tokens = future_tokens_of(tokens, targets, model.cfg.model.mtp_depth)
    micro = MicroBatch(tokens, targets, future_tokens=future_tokens)
    return objective_for(model.cfg, model.ps, name)(model, micro)
