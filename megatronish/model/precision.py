"""train.precision: the autocast context a forward runs under (weights, gradients and the
optimizer stay fp32), and under fp8 which linear layers and experts take fp8 GEMMs."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch import nn

from megatronish.config import Config
from megatronish.distributed.layout import ParallelState
from megatronish.fp8 import RECIPES, TokenGroups
from megatronish.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatronish.moe import MoELayer


def autocast(cfg: Config, device: torch.device):
    """bf16 autocast when train.precision is bf16 or fp8 (weights, grads and optimizer stay
    fp32)."""
    if cfg.train.bf16_autocast:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fp8_layers(model: nn.Module) -> list[ColumnParallelLinear | RowParallelLinear]:
    """The linear layers fp8 applies to: each block's attention projections and its dense MLP
    or its MoE layer's shared experts, the multi-token prediction blocks' too (not the
    embeddings, the output layer, the routers or anything outside the blocks; the routed experts
    are fp8_moe_layers')."""
    layers = []
    linears = (ColumnParallelLinear, RowParallelLinear)
    for block in _blocks(model):
        for part in (block.attn, block.mlp):
            layers += [m for m in part.modules() if isinstance(m, linears)]
    return layers


def fp8_moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers whose routed experts take fp8 grouped GEMMs (every block's)."""
    return [block.mlp for block in _blocks(model) if isinstance(block.mlp, MoELayer)]


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = list(model.blocks.values())
    if model.mtp is not None:
        blocks += [layer.block for layer in model.mtp.layers]
    return blocks


def use_precision(model: nn.Module, cfg: Config, ps: ParallelState) -> None:
    """Sets train.fp8_recipe (with kernels.backend) on fp8_layers(model) and fp8_moe_layers(model)
    when train.precision is fp8, with the groups their tokens are split over at cp > 1 (nothing
    otherwise: the other precisions are autocast alone)."""
    if cfg.train.precision != "fp8":
        return
    recipe = replace(RECIPES[cfg.train.fp8_recipe], backend=cfg.kernels.backend)
    tokens = TokenGroups(ps.cp_group, ps.tp_cp_group) if ps.cp > 1 else TokenGroups()
    for layer in fp8_layers(model):
        layer.fp8_recipe, layer.fp8_tokens = recipe, tokens
    for moe in fp8_moe_layers(model):
        moe.experts.use_fp8(recipe, moe.tp_group, tokens)
