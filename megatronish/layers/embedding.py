"""Vocab-parallel embedding: each tp rank holds a contiguous block of the vocabulary.

Shapes: b batch, s sequence, h embedding dim, V vocab, t tp group size.
  weight [V / t, h]; ids [b, s] (global ids) -> [b, s, h] (summed over the group)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatronish.distributed import comm
from megatronish.layers import mappings
from megatronish.layers.linear import DEFAULT_INIT, InitMethod, init_sharded, mark_parallel


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the global ids rank tp_rank holds."""
    per_rank = vocab_size // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """Looks up the ids this rank holds (zeros for the others), then all-reduces over the tp
    group so every rank has the full embedding. Backward needs no communication."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        init_method: InitMethod | None = DEFAULT_INIT,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = comm.group_size(tp_group)
        if num_embeddings % self.tp_size:
            raise ValueError(f"num_embeddings {num_embeddings} not divisible by tp {self.tp_size}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(
            num_embeddings, comm.group_rank(tp_group), self.tp_size
        )
        local = num_embeddings // self.tp_size
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        mark_parallel(self.weight, 0, (num_embeddings, embedding_dim))
        init_sharded(self.weight, init_method, 0, tp_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)  # [b, s, h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return mappings.reduce_from_tensor_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
            f"local ids [{self.vocab_start}, {self.vocab_end})"
        )
