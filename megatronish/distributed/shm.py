"""All-reduce, reduce, all-gather and ring shifts through shared memory, for a group of CPU
processes on one host.

gloo moves tensors between processes on one machine over loopback TCP (about 1 GB/s here),
which costs a CPU tensor-parallel step more than its matmuls can hide. Ranks of a group on one
host instead map one shared buffer: each rank copies its tensor into its own slot and publishes
a call counter; once every rank's counter has reached the call, each rank combines the slots in
rank order, so every rank computes the same bits. Two sets of slots are used alternately: a
rank can only be one call ahead of the slowest (it waits for every counter each call, and
finishes an asynchronous all-reduce before it publishes the next call), so the set it writes is
never one another rank still reads.

Each rank also publishes its pid, so a rank waiting for one that has exited (killed, or failed
and gone) raises PeerLost within PEER_CHECK_S instead of waiting for parallel.timeout_s.

Only x86-64 (whose stores are seen by other cores in program order, so a counter is never seen
before the data written ahead of it), only contiguous tensors (all-gathers and ring shifts up to
the slot size), and only SUM and MAX: ``SharedMemoryBackend``, the group's backend in
megatronish.distributed.comm, leaves everything else to gloo. MEGATRONISH_SHM=0 turns it off.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time

import torch
import torch.distributed as dist

from megatronish.distributed.backend import Backend
from megatronish.distributed.processes import process_alive
from megatronish.errors import PeerLost

SLOT_BYTES = 8 << 20
FLAG_BYTES = 4096
SPIN_BEFORE_YIELD = 64
# A wait longer than this sleeps between polls: the rank it waits for may need this core (more
# ranks than cores), and a rank that is this late costs far more than a poll's delay.
YIELD_BEFORE_SLEEP_S = 2e-3
SLEEP_S = 5e-5
PEER_CHECK_S = 0.5


class SharedMemoryGroup:
    """The shared buffer of one process group. Built collectively by every rank of the group
    (it uses the group's barrier once); `timeout_s` bounds every wait for the other ranks."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, slot_bytes: int = SLOT_BYTES):
        self.group, self.timeout_s, self.slot_bytes = group, timeout_s, slot_bytes
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        total = 2 * self.size * slot_bytes + FLAG_BYTES
        ranks = dist.get_process_group_ranks(group)
        name = f"megatronish-{os.environ.get('MASTER_PORT', '0')}-{'-'.join(map(str, ranks))}"
        path = os.path.join(shm_dir(), name)
        if self.rank == 0:
            with open(path, "wb") as f:
                f.truncate(total)
        dist.barrier(group)
        self.buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        # flags[r]: calls rank r made; flags[size + r]: rank r's pid.
        # (read and written through numpy, whose scalar access costs a tenth of torch indexing
        # in the wait loop).
        self.flags = self.buffer[-FLAG_BYTES:].view(torch.int64).numpy()
        self.flags[self.size + self.rank] = os.getpid()
        dist.barrier(group)
        if self.rank == 0:
            os.unlink(path)  # the mapping stays until the last process exits
        self.calls = 0
        self._pending: PendingCall | None = None

    def _slot(self, rank: int, parity: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        start = (parity * self.size + rank) * self.slot_bytes
        return self.buffer[start : start + nbytes].view(dtype)

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether all_gather_into can take tensor in one piece."""
        return tensor.is_contiguous() and tensor.numel() * tensor.element_size() <= self.slot_bytes

    def _publish(self, tensor: torch.Tensor) -> int:
        """Copies tensor into this rank's slot of the next call and announces it; returns the
        call. A call still pending completes first, so at most one call is in flight."""
        if self._pending is not None:
            self._pending.wait()
        self.calls += 1
        nbytes = tensor.numel() * tensor.element_size()
        self._slot(self.rank, self.calls % 2, nbytes, tensor.dtype).copy_(tensor.reshape(-1))
        self.flags[self.rank] = self.calls
        return self.calls

    def _collect(self, call: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Waits until every rank has published `call`; returns its slots in rank order."""
        start = time.monotonic()
        deadline, sleep_after = start + self.timeout_s, start + YIELD_BEFORE_SLEEP_S
        for rank in range(self.size):
            polls = 0
            next_check = time.monotonic() + PEER_CHECK_S
            while self.flags[rank] < call:
                polls += 1
                if polls > SPIN_BEFORE_YIELD:
                    now = time.monotonic()
                    if now > sleep_after:
                        time.sleep(SLEEP_S)
                    else:
                        os.sched_yield()
                    if now > next_check:
                        self._check_alive(rank, call)
                        next_check = now + PEER_CHECK_S
                    if now > deadline:
                        raise TimeoutError(
                            f"rank {rank} of a tensor-parallel group did not reach collective "
                            f"{call} within {self.timeout_s:.0f} s (parallel.timeout_s)"
                        )
        return [self._slot(r, call % 2, nbytes, dtype) for r in range(self.size)]

    def _check_alive(self, rank: int, call: int) -> None:
        """Raises PeerLost when rank's process has exited (or is a zombie)."""
        pid = int(self.flags[self.size + rank])
        if not process_alive(pid):
            raise PeerLost(
                f"rank {rank} of a process group on this host (pid {pid}) exited before "
                f"collective {call}"
            )

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Publishes tensor and waits for every rank's; returns the slots in rank order."""
        call = self._publish(tensor)
        return self._collect(call, tensor.numel() * tensor.element_size(), tensor.dtype)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType,
        out: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> PendingCall | None:
        """The sum (or max) of tensor over the group into out (default: tensor, in place; out
        is contiguous, of tensor's shape and dtype), combined in rank order on every rank; a
        tensor larger than a slot goes through in slot-sized pieces. With async_op a tensor
        that fits one slot is only published: the returned handle's wait() (or the next call
        on this group) waits for the other ranks and writes the result, so work done between
        the two overlaps their lateness. Neither tensor nor out may change until then."""
        combine = torch.add if op == dist.ReduceOp.SUM else torch.maximum
        per_slot = self.slot_bytes // tensor.element_size()
        target = tensor if out is None else out
        if async_op and tensor.numel() <= per_slot:
            call = self._publish(tensor)
            self._pending = PendingCall(
                self, call, tensor, lambda parts: _combine(parts, target.view(-1), combine)
            )
            return self._pending
        for piece, result in zip(tensor.view(-1).split(per_slot), target.view(-1).split(per_slot)):
            parts = self._exchange(piece)
            _combine(parts, result, combine)
        return None

    def reduce(self, tensor: torch.Tensor, root: int, async_op: bool = False) -> PendingCall | None:
        """The sum of tensor over the group into tensor on rank `root` of the group, combined in
        rank order as all_reduce combines it (the same bits); the other ranks publish theirs and
        combine nothing. Asynchronous as all_reduce is."""
        if self.rank == root:
            return self.all_reduce(tensor, dist.ReduceOp.SUM, async_op=async_op)
        per_slot = self.slot_bytes // tensor.element_size()
        if async_op and tensor.numel() <= per_slot:
            self._pending = PendingCall(self, self._publish(tensor), tensor, lambda parts: None)
            return self._pending
        for piece in tensor.view(-1).split(per_slot):
            self._exchange(piece)
        return None

    def reduce_scatter(self, tensor: torch.Tensor, async_op: bool = False) -> PendingCall | None:
        """Sums the 1-D tensor over the group into this rank's block of it (block r of
        tensor.chunk(size)), combined in rank order as all_reduce combines it, so the block has
        the bits an all-reduce would give; the other blocks are left as they are. Only the
        block is combined: each rank adds up 1 / size of the elements. Asynchronous as
        all_reduce is (a tensor that fits one slot is only published)."""
        per_slot = self.slot_bytes // tensor.element_size()
        block = tensor.numel() // self.size
        lo, hi = self.rank * block, (self.rank + 1) * block

        def finish(parts: list[torch.Tensor], start: int) -> None:
            a, b = max(lo, start), min(hi, start + parts[0].numel())
            if a < b:
                _combine([part[a - start : b - start] for part in parts], tensor[a:b], torch.add)

        if async_op and tensor.numel() <= per_slot:
            call = self._publish(tensor)
            self._pending = PendingCall(self, call, tensor, lambda parts: finish(parts, 0))
            return self._pending
        for start in range(0, tensor.numel(), per_slot):
            finish(self._exchange(tensor[start : start + per_slot]), start)
        return None

    def all_gather_blocks(self, tensor: torch.Tensor) -> None:
        """Block r of the 1-D tensor (tensor.chunk(size)) <- rank r's block r, on every rank;
        blocks larger than a slot go through in slot-sized pieces."""
        block = tensor.numel() // self.size
        per_slot = self.slot_bytes // tensor.element_size()
        blocks = tensor.view(self.size, block)
        for start in range(0, block, per_slot):
            parts = self._exchange(blocks[self.rank, start : start + per_slot])
            for rank, part in enumerate(parts):
                if rank != self.rank:
                    blocks[rank, start : start + part.numel()].copy_(part)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """output [size * n, ...] <- every rank's tensor [n, ...] in rank order."""
        parts = self._exchange(tensor)
        torch.cat(parts, out=output.view(-1))

    def shift(self, tensor: torch.Tensor, out: torch.Tensor) -> PendingCall:
        """A ring step: publishes tensor (contiguous, at most a slot) and returns a handle whose
        wait() (or the next call on this group) copies the previous rank's (rank - 1 mod size)
        tensor into out (contiguous, tensor's shape and dtype). It waits for every rank's
        tensor, not only the previous one's, which keeps every rank within one call of the
        slowest. Neither tensor nor out may change until then."""
        previous = (self.rank - 1) % self.size
        call = self._publish(tensor)
        self._pending = PendingCall(
            self, call, tensor, lambda parts: out.view(-1).copy_(parts[previous])
        )
        return self._pending


def _combine(parts: list[torch.Tensor], out: torch.Tensor, combine) -> None:
    """out <- combine of the ranks' parts, in rank order (the same bits on every rank)."""
    combine(parts[0], parts[1], out=out)
    for part in parts[2:]:
        combine(out, part, out=out)


class PendingCall:
    """A published call whose result wait() (or the group's next call) writes, by handing
    every rank's slot of the call, in rank order, to `finish`."""

    def __init__(self, group: SharedMemoryGroup, call: int, tensor: torch.Tensor, finish):
        self.group, self.call, self.finish = group, call, finish
        self.nbytes, self.dtype = tensor.numel() * tensor.element_size(), tensor.dtype
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.done = True
            self.group._pending = None
            self.finish(self.group._collect(self.call, self.nbytes, self.dtype))
        return True


class SharedMemoryBackend(Backend):
    """The collectives of a group whose ranks share one host: through its SharedMemoryGroup
    (`memory`) what shared memory can take, the rest through gloo (Backend)."""

    def __init__(self, memory: SharedMemoryGroup):
        self.memory = memory

    def all_reduce(self, tensor: torch.Tensor, group, op, async_op: bool):
        if tensor.is_contiguous() and op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            return self.memory.all_reduce(tensor, op, async_op=async_op)
        return super().all_reduce(tensor, group, op, async_op)

    def all_reduce_into(self, output: torch.Tensor, tensor: torch.Tensor, group) -> None:
        """output <- the sum of tensor over group, written there directly."""
        if tensor.is_contiguous() and output.is_contiguous():
            self.memory.all_reduce(tensor, dist.ReduceOp.SUM, out=output)
        else:
            super().all_reduce_into(output, tensor, group)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, group) -> None:
        if self.memory.fits(tensor) and output.is_contiguous():
            self.memory.all_gather_into(output, tensor)
        else:
            super().all_gather_into(output, tensor, group)

    def reduce_scatter_in_place(self, tensor: torch.Tensor, group, async_op: bool):
        """Combines only this rank's block, in rank order."""
        if tensor.is_contiguous():
            return self.memory.reduce_scatter(tensor, async_op=async_op)
        return super().reduce_scatter_in_place(tensor, group, async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, group, async_op: bool):
        if tensor.is_contiguous():
            root = dist.get_group_rank(group, dst)
            return self.memory.reduce(tensor, root, async_op=async_op)
        return super().reduce(tensor, dst, group, async_op)

    def all_gather_in_place(self, tensor: torch.Tensor, group, async_op: bool):
        """Gathers at once (None: nothing left to wait for)."""
        if tensor.is_contiguous():
            self.memory.all_gather_blocks(tensor)
            return None
        return super().all_gather_in_place(tensor, group, async_op)

    def shift(self, tensor, out, group, next_rank: int, prev_rank: int, tag: int):
        """A published slot (every rank of the group shifts together), else point-to-point."""
        if self.memory.fits(tensor) and out.is_contiguous():
            return self.memory.shift(tensor, out)
        return super().shift(tensor, out, group, next_rank, prev_rank, tag)


def shared_memory_backend(group: dist.ProcessGroup, timeout_s: float) -> SharedMemoryBackend | None:
    """group's SharedMemoryBackend when all its ranks can use shared memory, else None (they
    decide together, so none waits on a path the others skip). Every rank of group calls this;
    `timeout_s` bounds every wait for the other ranks."""
    ranks_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    vote = torch.tensor([1 if usable(group, ranks_per_host) else 0])
    dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
    return SharedMemoryBackend(SharedMemoryGroup(group, timeout_s)) if int(vote) else None


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def usable(group: dist.ProcessGroup, ranks_per_host: int) -> bool:
    """Whether this rank can use shared memory for group: gloo on x86-64, all the group's ranks
    on this host, room for the buffer, and not turned off with MEGATRONISH_SHM=0. (The ranks
    of the group must agree: see shared_memory_backend.)"""
    if os.environ.get("MEGATRONISH_SHM", "1") == "0" or platform.machine() not in (
        "x86_64",
        "AMD64",
    ):
        return False
    if dist.get_backend(group) != "gloo":
        return False
    ranks = dist.get_process_group_ranks(group)
    # torchrun numbers ranks node by node: ranks r and r' share a host iff r // n == r' // n.
    if len({r // ranks_per_host for r in ranks}) != 1:
        return False
    stat = os.statvfs(shm_dir())
    need = 2 * len(ranks) * SLOT_BYTES + FLAG_BYTES
    return stat.f_bavail * stat.f_frsize > 4 * need
