"""The LoRA adapters of a block's projections (model.lora: megatronish.layers.lora), each made
where its layer is built, and the freezing of everything else."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.config import ModelConfig
from megatronish.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatronish.layers.lora import ColumnAdapters, Lora, RowAdapter, is_adapter
from megatronish.model.plan import BlockPlan


def _lora(model: ModelConfig) -> Lora | None:
    spec = model.lora
    return None if spec is None else Lora(spec.rank, spec.alpha, spec.dropout)


def column_adapters(
    model: ModelConfig, plan: BlockPlan, d_in: int, parts: dict[str, int], units: int = 1
) -> ColumnAdapters | None:
    """The adapters of a column-parallel layer whose rows repeat `units` times the logical
    parts {Hugging Face name: rows per unit} (ColumnAdapters); None without model.lora or where
    no part is a target."""
    lora = _lora(model)
    targets = tuple(model.lora.targets) if lora else ()
    if lora is None or not set(parts) & set(targets):
        return None
    group = plan.ps.tp_group
    return ColumnAdapters(lora, d_in, parts, units, targets, group)


def row_adapter(
    model: ModelConfig, plan: BlockPlan, name: str, d_in: int, d_out: int
) -> RowAdapter | None:
    """The adapter of the row-parallel projection `name` (its Hugging Face name) [d_out, d_in];
    None without model.lora or where it is no target."""
    lora = _lora(model)
    if lora is None or name not in model.lora.targets:
        return None
    group, sp = plan.ps.tp_group, plan.linear_sequence_parallel
    return RowAdapter(lora, d_in, d_out, group, sp, plan.tracker)


def freeze_base(model: nn.Module, bf16: bool) -> None:
    """Every parameter but the adapters' frozen: no gradient, so no optimizer state and no
    data-parallel reduction (both take the parameters that require a gradient). bf16 (bf16
    autocast: train.precision bf16 or fp8): the linear layers' frozen weights are held in bf16
    alone, the copy autocast would make of them, with no fp32 master (never updated, they need
    none); the embeddings, norms and biases stay fp32 (the residual stream's precision)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if not bf16:
        return
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.weight.data = module.weight.data.to(torch.bfloat16)
