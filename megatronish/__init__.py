"""Megatron-style tensor-parallel GPT training. Importing the package is cheap: torch and the
model load only when a function that needs them is called."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from megatronish.inference.model import CheckpointModel


def load_model(
    checkpoint_dir: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> CheckpointModel:
    """The model of a checkpoint (a step directory, or a checkpoint.dir whose newest complete
    checkpoint is taken) saved at any layout, re-sharded to one process, in eval mode:
    model(tokens [b, s] int64) -> logits [b, s, vocab_size] over the real vocabulary."""
    from megatronish.inference.model import load_model as _load_model

    return _load_model(checkpoint_dir, device)
