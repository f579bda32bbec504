"""Every collective the project runs goes through these wrappers, which count its bytes.

A ``CommCounter`` used as a context manager records, for each collective issued inside it, the
payload size and the bytes this rank sends under the ring algorithm NCCL and gloo use for large
messages: all-reduce 2 (n-1)/n x payload, all-gather and reduce-scatter (n-1)/n x the full
tensor, broadcast (n-1)/n x payload. Tests and the benchmark compare these counts with the
analytic formula.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_ACTIVE: list[CommCounter] = []


@dataclass
class CommCounter:
    """Bytes and calls per collective kind while active (``with CommCounter() as c:``)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def __enter__(self) -> CommCounter:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def record(self, kind: str, payload: int, sent: float) -> None:
        self.calls[kind] += 1
        self.payload_bytes[kind] += payload
        self.sent_bytes[kind] += sent

    @property
    def total_sent(self) -> float:
        return sum(self.sent_bytes.values())

    @property
    def total_payload(self) -> int:
        return sum(self.payload_bytes.values())


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of group; 1 when no process group is initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in group; 0 when no process group is initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _record(kind: str, payload: int, factor: float) -> None:
    for counter in _ACTIVE:
        counter.record(kind, payload, payload * factor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
):
    """In-place all-reduce of tensor over group; returns the work handle when async_op."""
    n = group_size(group)
    if n == 1:
        return None
    _record("all_reduce", _nbytes(tensor), 2 * (n - 1) / n)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """Gathers each rank's tensor into output [n * tensor.shape[0], ...] (rank order on dim 0)."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    _record("all_gather", _nbytes(output), (n - 1) / n)
    dist.all_gather_into_tensor(output, tensor.contiguous(), group=group)


def reduce_scatter_into(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None
):
    """Sums tensor [n * output.shape[0], ...] over ranks; rank r keeps the r-th block of dim 0."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    _record("reduce_scatter", _nbytes(tensor), (n - 1) / n)
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce_scatter_tensor: all-reduce then keep the local block (same result).
        full = tensor.contiguous().clone()
        dist.all_reduce(full, group=group)
        output.copy_(full.chunk(n, dim=0)[group_rank(group)])
    else:
        dist.reduce_scatter_tensor(output, tensor.contiguous(), group=group)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Broadcasts tensor from global rank src to every rank of group."""
    n = group_size(group)
    if n == 1:
        return
    _record("broadcast", _nbytes(tensor), (n - 1) / n)
    dist.broadcast(tensor, src=src, group=group)
