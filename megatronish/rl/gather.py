"""What the last pipeline stage's cp shards computed, on every rank: per-token values of the
packed rows (log-probabilities, entropies) made whole and split back into sequences, and a
step's metrics summed over the rows.

Collectives: one all-gather over cp of the rows' shards (a zigzag shard per row), one
all-reduce over cp of the metrics' sums, and one broadcast over pp from the last stage; tp
ranks computed the same values, dp replicas the same rows.
"""

from __future__ import annotations

import torch

from megatronish.context.zigzag import unshard_sequence
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.objectives.batch import MicroBatch
from megatronish.rl.objective import PolicyObjective
from megatronish.rl.packing import Row, split_row

METRICS = ("loss", "clip_fraction", "kl", "entropy")


class RowResults:
    """The results of one call's rows, on every rank."""

    def __init__(self, ps: ParallelState, rows: list[Row], lengths: list[int]):
        self.ps, self.rows, self.lengths = ps, rows, lengths

    def per_sequence(
        self, objective: PolicyObjective, batch: list[MicroBatch]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(log-probabilities, entropies) of each sequence, float32 [n_i - 1], in the caller's
        order."""
        ps = self.ps
        local = [row.length // ps.cp for row in self.rows]
        if ps.is_last_stage:
            pieces = [
                torch.stack([objective.logprobs[id(m)], objective.entropies[id(m)]]) for m in batch
            ]
            flat = torch.cat(pieces, dim=1).float()  # [2, sum L / cp]
        else:
            flat = torch.empty(2, sum(local), device=ps.device)
        flat = self._from_last_stage(self._whole_rows(flat.contiguous(), local))
        logprobs: list = [None] * len(self.lengths)
        entropies: list = [None] * len(self.lengths)
        for row, values in zip(self.rows, flat.split([r.length for r in self.rows], 1)):
            for index, lp, ent in zip(
                row.members,
                split_row(row, values[0], self.lengths),
                split_row(row, values[1], self.lengths),
                strict=True,
            ):
                logprobs[index], entropies[index] = lp.cpu().clone(), ent.cpu().clone()
        return logprobs, entropies

    def metrics(self, objective: PolicyObjective) -> dict[str, float]:
        """The step's metrics (rl.losses), each the sum of the rows' shares."""
        ps = self.ps
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=ps.device)
        if ps.is_last_stage:
            for row_metrics in objective.metrics.values():
                for k, name in enumerate(METRICS):
                    if name in row_metrics:
                        sums[k] += row_metrics[name].double()
        if ps.cp > 1:
            comm.all_reduce(sums, ps.cp_group)
        sums = self._from_last_stage(sums)
        return dict(zip(METRICS, sums.tolist(), strict=True))

    def _whole_rows(self, flat: torch.Tensor, local: list[int]) -> torch.Tensor:
        """[2, sum L]: every row whole, from each cp rank's shards [2, sum L / cp]."""
        ps = self.ps
        if ps.cp == 1:
            return flat
        gathered = torch.empty(ps.cp * flat.shape[0], flat.shape[1], device=ps.device)
        comm.all_gather_into(gathered, flat, ps.cp_group)
        shards = gathered.view(ps.cp, 2, -1)
        rows = [
            unshard_sequence(list(shards[:, :, start : start + n].unbind(0)), dim=1)
            for start, n in zip(_starts(local), local, strict=True)
        ]
        return torch.cat(rows, dim=1)

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """tensor as the last pipeline stage holds it, on every stage."""
        ps = self.ps
        if ps.pp > 1:
            source = ps.global_rank(ps.tp_rank, ps.dp_rank, ps.pp - 1)
            comm.broadcast(tensor, source, ps.pp_group)
        return tensor


def _starts(sizes: list[int]) -> list[int]:
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    return starts
