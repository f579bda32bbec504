"""A rank's place in a ring of its group's ranks: it sends to the next rank and receives from
the previous one, one tensor per step, through comm.ring_shift (counted under the ring's kind).
Ring attention's cp ring (megatronish.context.ring) and the decomposed tp collectives'
ring (megatronish.layers.tp_ring) are both one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.distributed import comm


@dataclass(frozen=True)
class GroupRing:
    """This rank's place in its group: the group, its size and this rank's index in it, the
    global ranks of the next and the previous rank (the ring's direction of travel), and the
    kind its shifts are counted under."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    next_rank: int
    prev_rank: int
    kind: str

    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None, kind: str) -> GroupRing:
        """The ring of group (None: the default group) in its ranks' order, which has two ranks
        or more."""
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        size, rank = len(ranks), comm.group_rank(group)
        return cls(group, size, rank, ranks[(rank + 1) % size], ranks[(rank - 1) % size], kind)

    def shift(self, tensor: torch.Tensor, tag: int):
        """Starts sending tensor (contiguous) to the next rank and receiving the previous rank's
        into a new buffer: (buffer, pending); read the buffer after pending.wait()."""
        incoming = torch.empty_like(tensor)
        pending = comm.ring_shift(
            tensor, incoming, self.group, self.next_rank, self.prev_rank, tag, self.kind
        )
        return incoming, pending
