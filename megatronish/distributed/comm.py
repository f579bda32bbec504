"""Every collective the project runs goes through these wrappers, which count its bytes and
record it in the flight recorder (megatronish.observe.record: its sequence number on its
group, start and end, and the time this rank waited in it).

A ``CommCounter`` used as a context manager records, for each collective issued inside it, the
payload size and the bytes this rank sends under the ring algorithm NCCL and gloo use for large
messages: all-reduce 2 (n-1)/n x payload, all-gather and reduce-scatter (n-1)/n x the full
tensor, broadcast (n-1)/n x payload. Tests and the benchmark compare these counts with the
analytic formula.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatronish.distributed import shm
from megatronish.distributed.shm import SharedMemoryGroup
from megatronish.observe.profile import comm_range
from megatronish.observe.record import RECORDER, Timed

_ACTIVE: list[CommCounter] = []
# Groups whose ranks share one host and exchange through shared memory (distributed.shm).
_SHARED: dict[dist.ProcessGroup, SharedMemoryGroup] = {}


class _Done:
    """The work handle of a collective that has already completed."""

    def wait(self) -> bool:
        return True


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


@contextlib.contextmanager
def _recorded(op: str, group, tensor: torch.Tensor):
    """The body is a synchronous collective: a flight-recorder entry (its whole span is this
    rank's wait) and, while profiling, a range named after it."""
    entry = RECORDER.begin(op, group, tensor)
    with comm_range(op, entry.group):
        yield
    RECORDER.end(entry, entry.start)


def _issue(kind: str, group, tensor: torch.Tensor, async_op: bool, start):
    """Runs start(async_op), which issues the collective `kind` on tensor: synchronously inside a
    flight-recorder span, or asynchronously, returning a handle whose wait() closes the span
    (start may return None for a collective it finished at once)."""
    if not async_op:
        with _recorded(kind, group, tensor):
            start(False)
        return None
    entry = RECORDER.begin(kind, group, tensor)
    with comm_range(kind, entry.group):
        work = start(True)
    return Timed(work or _Done(), entry)


def _record(kind: str, payload: int, factor: float) -> None:
    for counter in _ACTIVE:
        counter.record(kind, payload, payload * factor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def enable_shared_memory(group: dist.ProcessGroup, timeout_s: float) -> bool:
    """Lets group's collectives go through shared memory when all its ranks can (they decide
    together, so none waits on a path the others skip). Every rank of group calls this."""
    ranks_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    vote = torch.tensor([1 if shm.usable(group, ranks_per_host) else 0])
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    if int(vote):
        _SHARED[group] = SharedMemoryGroup(group, timeout_s)
    return bool(int(vote))


def disable_shared_memory() -> None:
    """Forgets every shared-memory group (before the process groups are destroyed)."""
    _SHARED.clear()


def _shared(group, tensor: torch.Tensor, op) -> SharedMemoryGroup | None:
    """group's shared-memory path when it can reduce tensor with op, else None (gloo)."""
    shared = _SHARED.get(group)
    if shared is None or not tensor.is_contiguous():
        return None
    return shared if op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX) else None


def _all_reduce(tensor, group, op, async_op):
    shared = _shared(group, tensor, op)
    if shared is not None:
        return shared.all_reduce(tensor, op, async_op=async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _all_reduce_into(output, tensor, group) -> None:
    """output <- the sum of tensor over group (shared memory writes it there directly; gloo
    reduces a copy in place)."""
    shared = _shared(group, tensor, dist.ReduceOp.SUM)
    if shared is not None and output.is_contiguous():
        shared.all_reduce(tensor, dist.ReduceOp.SUM, out=output)
        return
    output.copy_(tensor)
    dist.all_reduce(output, group=group)


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
    return _issue(
        "all_reduce", group, tensor, async_op, lambda a: _all_reduce(tensor, group, op, a)
    )


def all_reduce_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """output (same shape and dtype) <- the sum of tensor over group; tensor is left as it is.
    Counted as an all-reduce of tensor. Saves the copy an in-place all-reduce of a tensor that
    must be kept would need."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    _record("all_reduce", _nbytes(tensor), 2 * (n - 1) / n)
    with _recorded("all_reduce", group, tensor):
        _all_reduce_into(output, tensor, group)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """Gathers each rank's tensor into output [n * tensor.shape[0], ...] (rank order on dim 0)."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    _record("all_gather", _nbytes(output), (n - 1) / n)
    shared = _SHARED.get(group)
    with _recorded("all_gather", group, tensor):
        if shared is not None and shared.fits(tensor) and output.is_contiguous():
            shared.all_gather_into(output, tensor.contiguous())
        else:
            dist.all_gather_single(output, tensor.contiguous(), group=group)


def reduce_scatter_into(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None
):
    """Sums tensor [n * output.shape[0], ...] over ranks; rank r keeps the r-th block of dim 0."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    _record("reduce_scatter", _nbytes(tensor), (n - 1) / n)
    with _recorded("reduce_scatter", group, tensor):
        if dist.get_backend(group) == "gloo":
            # gloo has no reduce-scatter: all-reduce then keep the local block.
            full = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            _all_reduce_into(full, tensor.contiguous(), group)
            output.copy_(full.chunk(n, dim=0)[group_rank(group)])
        else:
            dist.reduce_scatter_single(output, tensor.contiguous(), group=group)


def reduce_scatter_in_place(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
):
    """Sums the 1-D tensor (numel divisible by the group size n) over group so that afterwards
    block r of it (tensor.chunk(n)[r]) holds the sum on rank r; the other blocks are left
    undefined. Returns the work handle when async_op. Shared memory combines only this rank's
    block, in rank order; gloo, which has no reduce-scatter, all-reduces the whole tensor (the
    same sums, bit for bit); NCCL reduce-scatters into the block in place. Counted as a
    reduce_scatter of tensor."""
    n = group_size(group)
    if n == 1:
        return None
    _record("reduce_scatter", _nbytes(tensor), (n - 1) / n)
    return _issue(
        "reduce_scatter",
        group,
        tensor,
        async_op,
        lambda a: _reduce_scatter_in_place(tensor, group, n, a),
    )


def _reduce_scatter_in_place(tensor, group, n: int, async_op: bool):
    shared = _shared(group, tensor, dist.ReduceOp.SUM)
    if shared is not None:
        return shared.reduce_scatter(tensor, async_op=async_op)
    if dist.get_backend(group) == "gloo":
        return dist.all_reduce(tensor, group=group, async_op=async_op)
    block = tensor.chunk(n)[group_rank(group)]
    return dist.reduce_scatter_single(block, tensor, group=group, async_op=async_op)


def all_gather_in_place(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
):
    """Every rank's block r of the 1-D tensor (numel divisible by the group size n) <- rank r's
    block r: the blocks each rank updated, gathered. Returns the work handle when async_op
    (shared memory gathers at once and returns a finished handle). Counted as an all_gather
    of tensor."""
    n = group_size(group)
    if n == 1:
        return None
    _record("all_gather", _nbytes(tensor), (n - 1) / n)
    return _issue(
        "all_gather", group, tensor, async_op, lambda a: _all_gather_in_place(tensor, group, n, a)
    )


def _all_gather_in_place(tensor, group, n: int, async_op: bool):
    block = tensor.chunk(n)[group_rank(group)]
    shared = _SHARED.get(group)
    if shared is not None and tensor.is_contiguous():
        shared.all_gather_blocks(tensor)
        return None
    if dist.get_backend(group) == "gloo":
        block = block.clone()  # gloo's gather must not read what it writes
    return dist.all_gather_single(tensor, block, group=group, async_op=async_op)


def all_to_all(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Rank r sends rows input_splits[j] (dim 0, in order) of tensor to rank j of group and
    receives output_splits[j] rows from rank j into output, in rank order (all_to_all_single
    with split sizes; any split may be 0). Counted as "all_to_all": the payload is tensor, the
    bytes sent are the rows that leave this rank."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    row = _nbytes(tensor[:1]) if tensor.shape[0] else 0
    kept = input_splits[group_rank(group)]
    for counter in _ACTIVE:
        counter.record("all_to_all", _nbytes(tensor), float((tensor.shape[0] - kept) * row))
    with _recorded("all_to_all", group, tensor):
        dist.all_to_all_single(
            output, tensor.contiguous(), output_splits, input_splits, group=group
        )


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Broadcasts tensor from global rank src to every rank of group."""
    n = group_size(group)
    if n == 1:
        return
    _record("broadcast", _nbytes(tensor), (n - 1) / n)
    with _recorded("broadcast", group, tensor):
        dist.broadcast(tensor, src=src, group=group)


def start_exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None = None,
    kind: str = "p2p",
    tag: int = 0,
) -> Timed | _Done:
    """Posts sends of each (tensor, global peer rank) and receives into each (buffer, global
    peer rank) together, over group (None: the default group), and returns at once; the
    caller computes meanwhile and calls wait() before it reads a buffer or changes a sent
    tensor. Counted under `kind`: the bytes sent."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group, tag) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buffer, peer, group, tag) for buffer, peer in recvs]
    if not ops:
        return _Done()
    for tensor, _ in sends:
        _record(kind, _nbytes(tensor), 1.0)
    entry = RECORDER.begin(kind, group, (sends or recvs)[0][0])
    with comm_range(kind, entry.group):
        works = dist.batch_isend_irecv(ops)
    return Timed(_Works(works), entry)


class _Works:
    """Point-to-point works posted together; wait() waits for all of them."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def ring_shift(
    tensor: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup | None,
    next_rank: int,
    prev_rank: int,
    tag: int = 0,
    kind: str = "p2p",
) -> Timed | _Done:
    """One step around a ring of group's ranks: starts sending tensor to global rank next_rank
    and receiving prev_rank's tensor into out (contiguous, tensor's shape and dtype), and
    returns at once; wait() before reading out or changing tensor. Batched isend/irecv, or on a
    shared-memory group a published slot (every rank of the group shifts together). Counted
    under `kind`: the bytes sent."""
    shared = _SHARED.get(group)
    if shared is not None and shared.fits(tensor) and out.is_contiguous():
        _record(kind, _nbytes(tensor), 1.0)
        entry = RECORDER.begin(kind, group, tensor)
        with comm_range(kind, entry.group):
            pending = shared.shift(tensor.contiguous(), out)
        return Timed(pending, entry)
    return start_exchange([(tensor, next_rank)], [(out, prev_rank)], group, kind, tag)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Point-to-point: sends each (tensor, global peer rank) and receives into each (buffer,
    global peer rank), all posted together (so two neighbours that send to each other at once
    cannot deadlock), and waits for them. Counted as "p2p": the bytes sent."""
    start_exchange(sends, recvs).wait()


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether flag is set on any rank of the world (one all-reduce; every rank calls it)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(value, None, op=dist.ReduceOp.MAX)
    return bool(value.item())
