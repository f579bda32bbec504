"""What the last pipeline stage's cp shards computed, on every rank: per-token values of the
packed rows (log-probabilities, entropies) made whole and split back into sequences, and a
step's metrics summed over the rows.

Collectives: one all-gather over cp of the rows' shards (a zigzag shard per row), one
broadcast over pp from the last stage, then one all-gather over dp (each dp rank ran its share
of the rows); the metrics' sums take one all-reduce over dp x cp. The tp ranks computed the
same values.
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
    """The results of one call's rows (every row; dp rank r ran rows[r::dp]), on every rank."""

    def __init__(self, ps: ParallelState, rows: list[Row], lengths: list[int]):
        self.ps, self.rows, self.lengths = ps, rows, lengths

    def per_sequence(
        self, objective: PolicyObjective, batch: list[MicroBatch]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(log-probabilities, entropies) of each sequence, float32 [n_i - 1], in the caller's
        order; batch: this rank's micro-batches, its rows' first."""
        ps = self.ps
        mine = self.rows[ps.dp_rank :: ps.dp]
        local = [row.length // ps.cp for row in mine]
        if ps.is_last_stage:
            pieces = [
                torch.stack([objective.logprobs[id(m)], objective.entropies[id(m)]])
                for m in batch[: len(mine)]
            ]
            flat = torch.cat(pieces, dim=1).float()  # [2, sum L / cp]
        else:
            flat = torch.empty(2, sum(local), device=ps.device)
        flat = self._from_last_stage(self._whole_rows(flat.contiguous(), local))
        logprobs: list = [None] * len(self.lengths)
        entropies: list = [None] * len(self.lengths)
        for dp_rank, values in enumerate(self._of_dp_ranks(flat)):
            rows = self.rows[dp_rank :: ps.dp]
            for row, row_values in zip(rows, values.split([r.length for r in rows], 1)):
                for index, lp, ent in zip(
                    row.members,
                    split_row(row, row_values[0], self.lengths),
                    split_row(row, row_values[1], self.lengths),
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
        if ps.dp_cp > 1:
            comm.all_reduce(sums, ps.dp_cp_group)
        sums = self._from_last_stage(sums)
        return dict(zip(METRICS, sums.tolist(), strict=True))

    def _of_dp_ranks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each dp rank's whole rows [2, sum of its L], from this rank's (one all-gather over
        dp, each padded to the longest)."""
        ps = self.ps
        if ps.dp == 1:
            return [flat]
        sizes = [sum(row.length for row in self.rows[r :: ps.dp]) for r in range(ps.dp)]
        padded = flat.new_zeros(2, max(sizes))
        padded[:, : flat.shape[1]] = flat
        gathered = padded.new_empty(ps.dp * 2, max(sizes))
        comm.all_gather_into(gathered, padded, ps.dp_group)
        return [part[:, :size] for part, size in zip(gathered.view(ps.dp, 2, -1), sizes)]

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
