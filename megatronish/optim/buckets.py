"""What a gradient buffer (optim.grad_buffer) is made of: which parameters it holds, its
buckets, and under ZeRO the pieces of the parameters in this rank's block of a bucket."""

from __future__ import annotations

import torch
from torch import nn


def buffered(param: nn.Parameter) -> bool:
    """Whether param's gradient goes through the buffer (not a parameter summed elsewhere
    first)."""
    return not (
        getattr(param, "sequence_parallel_grad", False) or getattr(param, "pipeline_tied", False)
    )


class Bucket:
    """A run of the buffer's parameters reduced together over `group` (of `size` ranks), from
    start to stop in the buffer (padded to a multiple of size under ZeRO)."""

    def __init__(self, start: int, stop: int, params: list[nn.Parameter], group, size: int):
        self.start, self.stop, self.params, self.group, self.size = start, stop, params, group, size
        # the bucket's gradients (ZeRO-2 and 3: those of the micro-batches since its last
        # reduce-scatter, None between them)
        self.view: torch.Tensor | None = None
        self.pieces: list[Piece] = []  # ZeRO: the parts of params in this rank's block
        self.gather = None  # ZeRO-1: the parameter all-gather in flight
        self.pending = 0  # parameters still to produce their last micro-batch's gradient
        self.arrived = 0  # ZeRO-2 and 3: gradients the bucket received this step
        self.rank = 0  # this rank's index in group
        self.work = None


class Piece:
    """The part of a parameter that lies in this rank's shard of a bucket (ZeRO): 1-D views
    of the parameter (`data`, which carries the gradient part as `.grad`, so AdamW updates it
    as it updates a whole parameter), and where it lies in the flattened parameter."""

    def __init__(
        self, param: nn.Parameter, data: torch.Tensor, grad: torch.Tensor, lo: int, at: int
    ):
        self.param, self.data, self.lo, self.at = param, data, lo, at  # at: in the buffer
        self.data.grad = grad

    @property
    def grad(self) -> torch.Tensor:
        return self.data.grad
