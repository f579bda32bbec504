"""The tensor-parallel ring that megatronish.layers.overlap decomposes its collectives onto:
each rank sends to the next rank of its tp group and receives from the previous one, one
sequence chunk at a time, through megatronish.distributed.comm.ring_shift (counted as
"tp_ring": one call and the chunk's bytes per hop).

Shapes: b batch, c = s / t the chunk of the sequence rank r holds (its r-th contiguous block
along dim 1), t the tp group size. Chunks travel contiguous.

- ``gather_chunks``: the all-gather as t - 1 hops. A rank gets every rank's chunk in turn, its
  own first, then those of ranks r - 1, r - 2, ... (mod t); each is sent on before the caller
  computes on it, so the compute on one chunk overlaps the arrival of the next.
- ``RingReduceScatter``: the reduce-scatter as t - 1 hops. At step i a rank computes its
  partial for the block of rank r - 1 - i, adds the accumulator that arrived (the same block's
  sum so far) and sends it on; after t - 1 hops block r's accumulator is back at rank r. The
  block's sum is taken in ring order, rank r + 1 first, then r + 2, ..., r (mod t): another
  order of the same partial sums than the collective's (the same bits at t = 2, where a sum of
  two is commutative).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatronish.distributed.ring import GroupRing

GATHER_TAG, REDUCE_TAG = 21, 22  # the two rings a column backward runs at once


class TpRing(GroupRing):
    """This rank's place in its tp group's ring (shifts counted as "tp_ring")."""

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> TpRing:
        """The ring of group (None: the default group), which has two ranks or more."""
        return cls.of_group(group, "tp_ring")

    def block(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunk of x [b, s, ...] (dim 1, a view)."""
        c = x.shape[1] // self.size
        return x[:, rank * c : (rank + 1) * c]


def gather_chunks(
    ring: TpRing, local: torch.Tensor, tag: int = GATHER_TAG
) -> Iterator[tuple[int, torch.Tensor]]:
    """(source rank, its chunk) for every rank of the ring, this rank's own (local) first, then
    ranks r - 1, r - 2, ...: each chunk is on its way to the next rank before it is yielded, and
    the next one arrives while the caller computes on it."""
    held = local.contiguous()
    for step in range(ring.size):
        pending = None
        if step < ring.size - 1:
            incoming, pending = ring.shift(held, tag)
        yield (ring.rank - step) % ring.size, held
        if pending is not None:
            pending.wait()
            held = incoming


class RingReduceScatter:
    """A reduce-scatter around the ring (module doc): call add() t times, each with this rank's
    partial for the block of rank `destination`; then `result` is this rank's block of the sum
    over the ranks."""

    def __init__(self, ring: TpRing, tag: int = REDUCE_TAG):
        self.ring, self.tag, self.step = ring, tag, 0
        self.result: torch.Tensor | None = None
        self._incoming = self._pending = self._sending = None

    @property
    def destination(self) -> int:
        """The rank whose block the next add() contributes to."""
        return (self.ring.rank - 1 - self.step) % self.ring.size

    def add(self, partial: torch.Tensor) -> None:
        """Adds partial to the accumulator that arrived and sends the sum on (computing the
        partial overlapped that arrival); at the last step it is the result."""
        if self._pending is not None:
            self._pending.wait()
            partial = self._incoming.add_(partial)
        if self.step < self.ring.size - 1:
            self._sending = partial.contiguous()  # kept until its hop completes
            self._incoming, self._pending = self.ring.shift(self._sending, self.tag)
        else:
            self.result, self._incoming, self._pending, self._sending = partial, None, None, None
        self.step += 1
