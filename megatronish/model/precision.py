"""train.precision: the autocast context a forward runs under (weights, gradients and the
optimizer stay fp32)."""

from __future__ import annotations

import contextlib

import torch

from megatronish.config import Config


def autocast(cfg: Config, device: torch.device):
    """bf16 autocast when train.precision is bf16 (weights, grads and optimizer stay fp32)."""
    if cfg.train.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
