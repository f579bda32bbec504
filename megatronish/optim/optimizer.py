"""The learning-rate schedule and the parameter groups (the optimizers: optim.interface; which
parameters each rank updates, and how their gradients get there: megatronish.data_parallel)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from megatronish.config import Config


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup to train.lr over
    warmup_steps, then cosine decay to min_lr at train.steps."""
    train = cfg.train
    if train.warmup_steps > 0 and step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (2-D and up: linear weights and embeddings) only."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
