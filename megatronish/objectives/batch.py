"""A micro-batch as the step loop, the pipeline and the objectives pass it (MicroBatch), and a
step's batch split into its micro-batches (micro_batches).

Shapes: b micro-batch size, s sequence (s / cp on a cp rank: its zigzag shard), D
model.mtp_depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.context import Documents


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of this rank: what the first stage reads and what the objective needs."""

    tokens: torch.Tensor
    """The model's inputs, token ids [b, s]."""
    targets: torch.Tensor
    """The next tokens [b, s]; -100 where they do not count in the loss."""
    divisor: torch.Tensor | None = None
    """With a loss mask (training/loss.py): what the sum over the counted targets is divided
    by, a scalar, or [1 + D] (the main targets', then each depth's) with multi-token
    prediction; None: the mean over the counted targets."""
    documents: Documents | None = None
    """The tokens' documents under document masks (every pipeline stage needs them)."""
    future_tokens: torch.Tensor | None = None
    """With multi-token prediction, int64 [b, 2, D, s]: [:, 0, k - 1] the input tokens k
    positions ahead and [:, 1, k - 1] their targets (model.mtp.future_tokens_of of the whole
    sequences, then sharded like the tokens)."""
    reference: torch.Tensor | None = None
    """Under DPO, fp32 [b, 2]: the reference model's log-probability of each pair's chosen and
    rejected response (the sums over their tokens; None in the pass that computes them)."""


def micro_batches(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    divisor: torch.Tensor | None = None,
    documents: Documents | None = None,
    future_tokens: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """The micro-batches of a step's inputs and targets [accum, micro, s], with the step's
    divisor (shared by its micro-batches), their documents (None without document masks) and
    the tokens ahead [accum, micro, 2, D, s] (None without multi-token prediction)."""
    return [
        MicroBatch(
            x,
            y,
            divisor,
            None if documents is None else documents[index],
            None if future_tokens is None else future_tokens[index],
        )
        for index, (x, y) in enumerate(zip(inputs, targets))
    ]
