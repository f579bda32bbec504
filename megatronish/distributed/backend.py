"""How a group's collectives run. ``Backend`` runs them through torch.distributed (gloo or NCCL)
and works around what gloo lacks; a group whose ranks share one host may run them through
shared memory instead (megatronish.distributed.shm.SharedMemoryBackend, a Backend that takes
what shared memory can do and leaves the rest to this one). megatronish.distributed.comm picks a
group's backend and counts and records each call; a backend only moves the bytes.

Every method is called with group of two ranks or more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _own_block(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Block r of tensor's dim 0 (tensor.chunk(n)) on rank r of group (n ranks)."""
    return tensor.chunk(dist.get_world_size(group))[dist.get_rank(group)]


class Works:
    """Point-to-point works posted together; wait() waits for all of them."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class Backend:
    """The collectives of a group through torch.distributed."""

    def all_reduce(self, tensor: torch.Tensor, group, op, async_op: bool):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_reduce_into(self, output: torch.Tensor, tensor: torch.Tensor, group) -> None:
        """output <- the sum of tensor over group (gloo reduces a copy in place)."""
        output.copy_(tensor)
        dist.all_reduce(output, group=group)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, group) -> None:
        dist.all_gather_single(output, tensor.contiguous(), group=group)

    def reduce_scatter_into(self, output: torch.Tensor, tensor: torch.Tensor, group) -> None:
        if dist.get_backend(group) == "gloo":
            # gloo has no reduce-scatter: all-reduce then keep the local block.
            full = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            self.all_reduce_into(full, tensor.contiguous(), group)
            output.copy_(_own_block(full, group))
        else:
            dist.reduce_scatter_single(output, tensor.contiguous(), group=group)

    def reduce_scatter_in_place(self, tensor: torch.Tensor, group, async_op: bool):
        if dist.get_backend(group) == "gloo":
            # gloo has no reduce-scatter: all-reduce the whole tensor (the same sums, bit for bit).
            return dist.all_reduce(tensor, group=group, async_op=async_op)
        block = _own_block(tensor, group)
        return dist.reduce_scatter_single(block, tensor, group=group, async_op=async_op)

    def all_gather_in_place(self, tensor: torch.Tensor, group, async_op: bool):
        block = _own_block(tensor, group)
        if dist.get_backend(group) == "gloo":
            block = block.clone()  # gloo's gather must not read what it writes
        return dist.all_gather_single(tensor, block, group=group, async_op=async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group,
    ) -> None:
        dist.all_to_all_single(
            output, tensor.contiguous(), output_splits, input_splits, group=group
        )

    def reduce(self, tensor: torch.Tensor, dst: int, group, async_op: bool):
        return dist.reduce(tensor, dst=dst, group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group) -> None:
        dist.broadcast(tensor, src=src, group=group)

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        group,
        tag: int,
    ) -> Works:
        """Posts the sends of each (tensor, global peer rank) and receives into each (buffer,
        global peer rank) together (at least one of either)."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group, tag) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, buffer, peer, group, tag) for buffer, peer in recvs]
        return Works(dist.batch_isend_irecv(ops))

    def shift(
        self,
        tensor: torch.Tensor,
        out: torch.Tensor,
        group,
        next_rank: int,
        prev_rank: int,
        tag: int,
    ):
        """Starts a ring step: tensor to global rank next_rank, prev_rank's into out."""
        return self.exchange([(tensor, next_rank)], [(out, prev_rank)], group, tag)


TORCH = Backend()
