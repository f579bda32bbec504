"""train.precision: the autocast context a forward runs under (weights, gradients and the
optimizer stay fp32), and under fp8 which linear layers and experts of a built model take fp8
GEMMs (their plans, megatronish.model.plan)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megatronish.config import Config
from megatronish.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatronish.moe import MoELayer


def autocast(cfg: Config, device: torch.device):
    """bf16 autocast when train.precision is bf16 or fp8 (weights, grads and optimizer stay
    fp32)."""
    if cfg.train.bf16_autocast:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fp8_layers(model: nn.Module) -> list[ColumnParallelLinear | RowParallelLinear]:
    """The linear layers whose plan makes their GEMMs fp8 (ModelPlan.blocks'; the routed
    experts are fp8_moe_layers')."""
    linears = (ColumnParallelLinear, RowParallelLinear)
    return [m for m in model.modules() if isinstance(m, linears) and m.plan.recipe is not None]


def fp8_moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers whose routed experts take fp8 grouped GEMMs."""
    return [m for m in model.modules() if isinstance(m, MoELayer) and m.experts.recipe is not None]
