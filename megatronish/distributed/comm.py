"""Every collective the project runs: what each one moves and what it counts as on the wire.

Each collective runs on its group's backend (megatronish.distributed.backend: torch.distributed,
or shared memory for a group that ``enable_shared_memory`` turned it on for) inside
megatronish.distributed.bookkeeping.observed, which counts its bytes in every active
``CommCounter`` and records it in the flight recorder and the profiler. On a group of one rank
a collective moves nothing and is neither counted nor recorded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatronish.distributed.backend import TORCH, Backend
from megatronish.distributed.bookkeeping import CommCounter as CommCounter  # comm.CommCounter
from megatronish.distributed.bookkeeping import Done, observed
from megatronish.distributed.shm import shared_memory_backend
from megatronish.observe.record import Timed

# Groups whose collectives do not run on TORCH (their ranks share one host: shared memory).
_BACKENDS: dict[dist.ProcessGroup, Backend] = {}


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


def backend(group: dist.ProcessGroup | None) -> Backend:
    """The backend group's collectives run on."""
    return _BACKENDS.get(group, TORCH)


def enable_shared_memory(group: dist.ProcessGroup, timeout_s: float) -> bool:
    """Lets group's collectives go through shared memory when all its ranks can (they decide
    together, so none waits on a path the others skip); returns whether they do. Every rank of
    group calls this; `timeout_s` bounds every wait for the other ranks."""
    shared = shared_memory_backend(group, timeout_s)
    if shared is not None:
        _BACKENDS[group] = shared
    return shared is not None


def disable_shared_memory() -> None:
    """Forgets every shared-memory group (before the process groups are destroyed)."""
    _BACKENDS.clear()


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
    payload = _nbytes(tensor)
    return observed(
        "all_reduce",
        group,
        tensor,
        payload,
        payload * (2 * (n - 1) / n),
        lambda a: backend(group).all_reduce(tensor, group, op, a),
        async_op,
    )


def all_reduce_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """output (same shape and dtype) <- the sum of tensor over group; tensor is left as it is.
    Counted as an all-reduce of tensor. Saves the copy an in-place all-reduce of a tensor that
    must be kept would need."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    payload = _nbytes(tensor)
    observed(
        "all_reduce",
        group,
        tensor,
        payload,
        payload * (2 * (n - 1) / n),
        lambda _: backend(group).all_reduce_into(output, tensor, group),
    )


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """Gathers each rank's tensor into output [n * tensor.shape[0], ...] (rank order on dim 0).
    Counted as an all_gather of output."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    payload = _nbytes(output)
    observed(
        "all_gather",
        group,
        tensor,
        payload,
        payload * ((n - 1) / n),
        lambda _: backend(group).all_gather_into(output, tensor, group),
    )


def reduce_scatter_into(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None
):
    """Sums tensor [n * output.shape[0], ...] over ranks; rank r keeps the r-th block of dim 0."""
    n = group_size(group)
    if n == 1:
        output.copy_(tensor)
        return
    payload = _nbytes(tensor)
    observed(
        "reduce_scatter",
        group,
        tensor,
        payload,
        payload * ((n - 1) / n),
        lambda _: backend(group).reduce_scatter_into(output, tensor, group),
    )


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
    payload = _nbytes(tensor)
    return observed(
        "reduce_scatter",
        group,
        tensor,
        payload,
        payload * ((n - 1) / n),
        lambda a: backend(group).reduce_scatter_in_place(tensor, group, a),
        async_op,
    )


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
    payload = _nbytes(tensor)
    return observed(
        "all_gather",
        group,
        tensor,
        payload,
        payload * ((n - 1) / n),
        lambda a: backend(group).all_gather_in_place(tensor, group, a),
        async_op,
    )


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
    leaving = tensor.shape[0] - input_splits[group_rank(group)]
    observed(
        "all_to_all",
        group,
        tensor,
        _nbytes(tensor),
        float(leaving * row),
        lambda _: backend(group).all_to_all(output, tensor, output_splits, input_splits, group),
    )


def reduce(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None, async_op: bool = False):
    """The sum of tensor over group into tensor on global rank dst (the other ranks' tensor is
    left undefined); returns the work handle when async_op. Counted as a reduce of tensor, of
    which a rank sends (n-1)/n: half an all-reduce's."""
    n = group_size(group)
    if n == 1:
        return None
    payload = _nbytes(tensor)
    return observed(
        "reduce",
        group,
        tensor,
        payload,
        payload * ((n - 1) / n),
        lambda a: backend(group).reduce(tensor, dst, group, a),
        async_op,
    )


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Broadcasts tensor from global rank src to every rank of group."""
    n = group_size(group)
    if n == 1:
        return
    payload = _nbytes(tensor)
    observed(
        "broadcast",
        group,
        tensor,
        payload,
        payload * ((n - 1) / n),
        lambda _: backend(group).broadcast(tensor, src, group),
    )


def start_exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None = None,
    kind: str = "p2p",
    tag: int = 0,
) -> Timed | Done:
    """Posts sends of each (tensor, global peer rank) and receives into each (buffer, global
    peer rank) together, over group (None: the default group), and returns at once; the
    caller computes meanwhile and calls wait() before it reads a buffer or changes a sent
    tensor. Counted under `kind`: one call per send, the bytes sent."""
    if not sends and not recvs:
        return Done()
    payload = sum(_nbytes(tensor) for tensor, _ in sends)
    return observed(
        kind,
        group,
        (sends or recvs)[0][0],
        payload,
        float(payload),
        lambda _: backend(group).exchange(sends, recvs, group, tag),
        async_op=True,
        calls=len(sends),
    )


def ring_shift(
    tensor: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup | None,
    next_rank: int,
    prev_rank: int,
    tag: int = 0,
    kind: str = "p2p",
) -> Timed:
    """One step around a ring of group's ranks: starts sending tensor to global rank next_rank
    and receiving prev_rank's tensor into out (contiguous, tensor's shape and dtype), and
    returns at once; wait() before reading out or changing tensor. Batched isend/irecv, or on a
    shared-memory group a published slot (every rank of the group shifts together). Counted
    under `kind`: the bytes sent."""
    payload = _nbytes(tensor)
    return observed(
        kind,
        group,
        tensor,
        payload,
        float(payload),
        lambda _: backend(group).shift(tensor, out, group, next_rank, prev_rank, tag),
        async_op=True,
    )


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
