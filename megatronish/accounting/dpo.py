"""DPO's one-time reference pass (train.objective dpo; training.preference): before the first
step, one forward over every train and validation pair at the initial weights, each pair a row
of train.seq_len tokens, each split's pairs in whole global batches (the last one filled up with
repeats that are not kept); then the table of two fp32 log-probabilities a pair of the dataset,
held on every rank (while it is computed, fp64 sums and token counts: four fp64 a pair).

Time: a training step's model FLOPs are three passes of the forward's (accounting.flops: the
backward twice the forward), so a global batch's forward is a third of a step's FLOPs, and at
the step's predicted throughput a third of its time (an estimate from above: a step's time also
holds its gradient reduction and optimizer, which the pass does not run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatronish.config import Config

TABLE_BYTES_PER_PAIR = 2 * 4  # the chosen and rejected log-probabilities, fp32
WORKING_BYTES_PER_PAIR = 2 * 2 * 8  # while computed: their sums and token counts, fp64


@dataclass(frozen=True)
class ReferencePass:
    """The reference pass of a DPO run: global batches and tokens forwarded, their model FLOPs,
    and the table's bytes on every rank (kept, and while computed)."""

    batches: int
    tokens: int
    flops: float
    table_bytes: int
    working_bytes: int

    def seconds(self, step_time_s: float) -> float:
        """The pass's time at a training step's predicted time (see the module docstring)."""
        return self.batches * step_time_s / 3


def reference_pass(
    cfg: Config, step_flops: float, split_pairs: Sequence[int], dataset_pairs: int
) -> ReferencePass:
    """The pass of a DPO run of cfg over splits of split_pairs pairs each (train, validation)
    of a dataset of dataset_pairs, a training step being step_flops model FLOPs
    (accounting.flops.model_flops_per_step)."""
    size = cfg.train.global_batch_size
    batches = sum(math.ceil(pairs / size) for pairs in split_pairs)
    return ReferencePass(
        batches=batches,
        tokens=batches * size * cfg.train.seq_len,
        flops=batches * step_flops / 3,
        table_bytes=dataset_pairs * TABLE_BYTES_PER_PAIR,
        working_bytes=dataset_pairs * WORKING_BYTES_PER_PAIR,
    )
