"""Auxiliary-loss-free balancing (DeepSeek-V3, sigmoid router): after each optimizer step every
MoE layer's routing bias moves by model.moe.bias_update_speed u towards balance,

    bias_i += u x sign(mean_j load_j - load_i),

load_i the assignments routed to expert i over the whole global batch: every micro-batch of
every rank, summed by one all-reduce of a [MoE layers, E] int64 table over all ranks (each
stage fills its own layers' rows; where the tp ranks route the same tokens only tp rank 0
contributes). Every rank so sees the same loads and its layers' biases stay identical at every
layout. The loads also give the step's expert-load spread (max / mean over experts) for
metrics.jsonl, with the sigmoid router at any speed (0 included).
"""

from __future__ import annotations

import torch

from megatronish.distributed import comm
from megatronish.moe.layer import MoELayer


@torch.no_grad()
def global_loads(
    layers: dict[int, MoELayer], moe_layers: tuple[int, ...], num_experts: int, ps
) -> torch.Tensor:
    """The step's routed assignments per expert of every MoE layer, over the whole global batch
    ([len(moe_layers), E] int64 on ps.device; every rank calls this). Resets the layers'
    counts."""
    table = torch.zeros(len(moe_layers), num_experts, dtype=torch.int64, device=ps.device)
    for index, layer in layers.items():
        load, layer.load = layer.load, torch.zeros_like(layer.load)
        if ps.tp_rank == 0 or layer.sequence_parallel:
            table[moe_layers.index(index)] += load.to(ps.device)
    if ps.world_size > 1:
        comm.all_reduce(table, None)
    return table


@torch.no_grad()
def update_biases(layers: dict[int, MoELayer], loads: torch.Tensor, moe_layers, speed: float):
    """Moves each of this rank's layers' bias by speed x sign(mean load - load) (loads
    [len(moe_layers), E], from global_loads)."""
    for index, layer in layers.items():
        load = loads[moe_layers.index(index)].double()
        step = torch.sign(load.mean() - load) * speed
        bias = layer.router.bias
        bias.add_(step.to(device=bias.device, dtype=bias.dtype))


def load_spread(loads: torch.Tensor) -> dict[str, float]:
    """moe_load_spread: max over layers of (the busiest expert's load / the mean load) of one
    step; moe_load_spread_mean: the mean over layers of that ratio."""
    loads = loads.double().cpu()
    ratio = loads.max(1).values / loads.mean(1).clamp(min=1e-12)
    return {"moe_load_spread": float(ratio.max()), "moe_load_spread_mean": float(ratio.mean())}


class Balancer:
    """The trainer's end of step for the sigmoid router: the global loads, the bias update
    (when the step's update was applied) and the last step's load spread for metrics.jsonl.
    Does nothing for other routers."""

    def __init__(self, layers: dict[int, MoELayer], cfg, derived, ps):
        moe = cfg.model.moe
        self.active = moe.num_experts > 0 and moe.router == "sigmoid"
        self.layers, self.moe_layers, self.ps = layers, derived.moe_layers, ps
        self.num_experts, self.speed = moe.num_experts, moe.bias_update_speed
        self.loads: torch.Tensor | None = None

    def after_step(self, applied: bool) -> None:
        """Every rank calls this once per step, after the optimizer (applied: the step's update
        was applied, not skipped)."""
        if not self.active:
            return
        self.loads = global_loads(self.layers, self.moe_layers, self.num_experts, self.ps)
        if applied and self.speed > 0:
            update_biases(self.layers, self.loads, self.moe_layers, self.speed)

    def metrics(self) -> dict[str, float]:
        """The last step's moe_load_spread fields (none before a step, or without biases)."""
        return load_spread(self.loads) if self.loads is not None else {}
