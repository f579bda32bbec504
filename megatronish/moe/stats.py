"""What the MoE layers did over a step, for metrics.jsonl and the progress bar.

Each MoE layer counts, over the step's training micro-batches on its rank: the routed
assignments per expert (before capacity drops), the dropped ones, and its shares of the
balancing and z-losses. At a logged step `step_metrics` sums them over every rank (tp rank 0
only where the tp ranks route the same tokens, every tp rank under sequence parallelism)
into:
  moe_aux_loss     the load-balancing loss (1 at perfect balance), mean over layers and
                   micro-batches
  moe_z_loss       the router z-loss, the same mean
  moe_imbalance    max over layers of (tokens of the busiest expert / mean tokens per expert)
  moe_imbalance_mean   the mean over layers of that ratio
  moe_dropped_frac dropped assignments / routed assignments (0 when dropless)
  moe_bias_range   (sigmoid router) max over layers of the routing bias's max - min now
"""

from __future__ import annotations

import torch

from megatronish.distributed import comm


class LayerStats:
    """One MoE layer's sums since the last step_metrics, on the layer's device (no host sync
    on the step's path)."""

    def __init__(
        self, num_experts: int, split_over_tp: bool = False, bias: torch.Tensor | None = None
    ):
        self.num_experts = num_experts
        self.bias = bias  # the layer's routing bias (sigmoid router), for moe_bias_range
        # Under sequence parallelism each tp rank routes its own tokens (and counts them); the
        # capacity drops are of the gathered micro-batch, the same on every tp rank.
        self.split_over_tp = split_over_tp
        self.sums: torch.Tensor | None = None  # [E + 4]: counts, dropped, balance, z, micro

    @torch.no_grad()
    def add(
        self,
        counts: torch.Tensor,
        keep: torch.Tensor | None,
        balance: torch.Tensor,
        z: torch.Tensor,
    ) -> None:
        """One micro-batch: counts [E] the routed assignments per expert, keep [T, k] which
        were kept (None: dropless), this rank's shares of its balancing and z-losses."""
        routed = counts.double()
        dropped = (~keep).sum().double() if keep is not None else routed.new_zeros(())
        one = routed.new_ones(())
        row = torch.cat([routed, torch.stack([dropped, balance.double(), z.double(), one])])
        self.sums = row if self.sums is None else self.sums + row

    def take(self) -> torch.Tensor | None:
        sums, self.sums = self.sums, None
        return sums


def step_metrics(
    layers: dict[int, LayerStats],
    moe_layers: tuple[int, ...],
    num_experts: int,
    ps,
    biased: bool = False,
) -> dict[str, float]:
    """The moe_* metrics since the last call (every rank calls it; it resets the sums).
    layers: this rank's MoE layers by block index; moe_layers: every MoE block index; biased:
    the layers have routing biases (moe_bias_range)."""
    if not moe_layers:
        return {}
    table = torch.zeros(len(moe_layers), num_experts + 5, dtype=torch.float64, device=ps.device)
    for index, stats in layers.items():
        sums = stats.take()
        if sums is None or (ps.tp_rank != 0 and not stats.split_over_tp):
            continue
        row = table[moe_layers.index(index)]
        row[:-1].copy_(sums)
        if ps.tp_rank != 0:
            row[num_experts] = 0  # the drops are the same on every tp rank: counted once
        if ps.cp_rank != 0 or ps.tp_rank != 0:
            row[-2] = 0  # the micro-batches are counted once per dp rank
        elif stats.bias is not None and ps.dp_rank == 0:  # the same everywhere: one rank's
            row[-1] = stats.bias.max() - stats.bias.min()
    if ps.world_size > 1:
        comm.all_reduce(table, None)
    table = table.cpu()
    counts, dropped = table[:, :num_experts], table[:, num_experts]
    micro = table[:, -2].clamp(min=1)
    routed = counts.sum(1).clamp(min=1)
    imbalance = counts.max(1).values / (routed / num_experts)
    biased = {"moe_bias_range": float(table[:, -1].max())} if biased else {}
    return biased | {
        "moe_aux_loss": float((table[:, num_experts + 1] / micro).mean()),
        "moe_z_loss": float((table[:, num_experts + 2] / micro).mean()),
        "moe_imbalance": float(imbalance.max()),
        "moe_imbalance_mean": float(imbalance.mean()),
        "moe_dropped_frac": float(dropped.sum() / routed.sum()),
    }
