"""The communication of the Triton vocab-parallel cross entropy, kept out of the kernels.

megatronish_kernels.cross_entropy computes each rank's per-row statistics of its vocab shard
and hands them to a VocabSplit; this module's split merges them across a tp process group
through megatronish.distributed.comm (so every byte is counted): one all-gather of each rank's
log-sum-exp [tp, rows] and one SUM all-reduce of the target logit [rows], both fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.distributed import comm


@dataclass(frozen=True)
class GroupVocabSplit:
    """The vocab split over the ranks of tp_group; rank and size are this rank's place in it."""

    tp_group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, tp_group: dist.ProcessGroup | None) -> GroupVocabSplit | None:
        """The split over tp_group (None: the default group if torch.distributed is
        initialized), or None when the group has one rank (the whole vocab is local)."""
        size = comm.group_size(tp_group)
        if size == 1:
            return None
        return cls(tp_group, comm.group_rank(tp_group), size)

    def combine(
        self, lse: torch.Tensor, target_logit: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global (lse, target logit) [rows] from this rank's: an all-gather of lse into
        [tp, rows] reduced by logsumexp, and a SUM all-reduce of target_logit in place."""
        n_rows = lse.shape[0]
        all_lse = torch.empty(self.size * n_rows, device=lse.device, dtype=lse.dtype)
        comm.all_gather_into(all_lse, lse, self.tp_group)
        comm.all_reduce(target_logit, self.tp_group, op=dist.ReduceOp.SUM)
        return torch.logsumexp(all_lse.view(self.size, n_rows), dim=0), target_logit
