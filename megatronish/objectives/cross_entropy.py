"""The mean cross-entropy of a micro-batch's targets from this tp rank's logits (the
vocab-parallel loss, megatronish.ops.cross_entropy), as the loss normalization of
training/loss.py needs it under cp and loss masks."""

from __future__ import annotations

import torch

from megatronish import ops
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.observe.profile import annotate


def mean_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    divisor: torch.Tensor | None,
    ps: ParallelState,
    backend: str,
) -> torch.Tensor:
    """Mean cross entropy over the tokens whose target is not -100 (logits [b, s, V / t]).
    Under cp the count is the whole sequences' (summed over the cp group) and the value is
    scaled by cp, so the mean over the cp group of this loss (and of its gradients) is the full
    sequences' mean, however the targets that count fall on the cp ranks. With `divisor` (a
    loss mask: training/loss.py) the sum over the counted targets divided by it, with no
    collective. backend: kernels.backend."""
    with annotate("loss"):
        per_token = ops.cross_entropy(logits, targets, ps.tp_group, backend=backend)
    if divisor is not None:
        return per_token.float().sum() / divisor
    count = (targets != -100).sum()
    if ps.cp > 1:
        count = count.to(torch.float64).reshape(1)
        comm.all_reduce(count, ps.cp_group)
        return per_token.float().sum() * ps.cp / count.clamp(min=1).float()[0]
    return per_token.float().sum() / count.clamp(min=1)
