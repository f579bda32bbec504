"""How the micro-batch losses of a step become its loss: the mean over the global batch.

Without a loss mask every micro-batch has the same number of targets, so the loss is the mean
of the micro-batch means (objectives.cross_entropy), averaged over the dp x cp group with the
gradients. With a loss mask (SFT data, data.eod_mask_loss: targets that do not count are -100)
the micro-batches count different numbers of targets, and the loss is the sum over every
counted target of the global batch divided by their number N, whatever the layout. One fp64
all-reduce over dp x cp per step gives N; each micro-batch's loss is then its sum over its
counted targets divided by `counted_share` / accum = N / (dp x cp x accum). The trainer scales
it by 1 / accum for backward and the gradient reduction averages over dp x cp, so the gradients
are those of sum / N on one process, and so is the mean of the reported losses. Multi-token
prediction (model.mtp_depth) does the same for the targets of each depth (their own N), in the
same all-reduce, and its loss is averaged with the main loss's (mean_losses).
"""

from __future__ import annotations

import torch

from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.layers.cross_entropy import IGNORE_INDEX


def mean_loss(value: torch.Tensor, ps: ParallelState) -> float:
    """Mean over the dp x cp group of a loss computed on the last pipeline stage, on every
    rank (the other stages contribute zeros to a sum over the pipeline)."""
    return batch_means(value.reshape(1), ps)[0]


def mean_losses(
    main: torch.Tensor, mtp: torch.Tensor | None, ps: ParallelState
) -> tuple[float, float | None]:
    """mean_loss of the main loss and of the multi-token prediction loss (None: none), with
    the collectives of one."""
    if mtp is None:
        return mean_loss(main, ps), None
    main_mean, mtp_mean = batch_means(torch.stack([main, mtp]), ps)
    return main_mean, mtp_mean


def batch_means(values: torch.Tensor, ps: ParallelState) -> list[float]:
    """mean_loss of each of values [n] (each the same on every tp rank), in one all-reduce over
    each group."""
    values = values.detach().float().clone()
    if ps.dp_cp > 1:
        comm.all_reduce(values, ps.dp_cp_group)
        values /= ps.dp_cp
    if ps.pp > 1:
        if not ps.is_last_stage:
            values.zero_()
        comm.all_reduce(values, ps.pp_group)
    return values.tolist()


def counted_targets(targets: torch.Tensor) -> torch.Tensor:
    """The targets of `targets` that count in the loss (not -100) on this rank: int64 scalar."""
    return (targets != IGNORE_INDEX).sum()


def counted_share(targets: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """N / (dp x cp), fp32 scalar: N the counted targets (counted_targets) of `targets` on every
    rank of the dp x cp group (one fp64 all-reduce when it has more than one rank), at least 1."""
    return counted_shares([targets], ps)[0]


def loss_divisor(
    targets: torch.Tensor, future_tokens: torch.Tensor | None, ps: ParallelState
) -> torch.Tensor:
    """counted_share of a step's targets [accum, micro, s]: a scalar; with the tokens ahead
    (multi-token prediction, [accum, micro, 2, D, s]) [1 + D], the main targets' and each
    depth's, in one all-reduce."""
    if future_tokens is None:
        return counted_share(targets, ps)
    return counted_shares([targets, *future_tokens[:, :, 1].unbind(2)], ps)


def counted_shares(targets: list[torch.Tensor], ps: ParallelState) -> torch.Tensor:
    """counted_share of each of `targets`, fp32 [n], with one all-reduce."""
    count = torch.stack([counted_targets(t) for t in targets]).to(torch.float64)
    if ps.dp_cp > 1:
        comm.all_reduce(count, ps.dp_cp_group)
    return (count.clamp(min=1) / ps.dp_cp).float()
