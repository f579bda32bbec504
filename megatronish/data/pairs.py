"""Batches of preference pairs for DPO (train.objective dpo), from a dataset written by
`prepare --preference` (preference.py).

Legend: G global batch size (pairs per optimizer step), m micro-batch size (pairs), s seq_len.
Sample i of a split is its i-th pair, laid out as one row of s + 1 tokens: the chosen
conversation, the rejected one, then end-of-text tokens to the end. The three are documents of
their own (the loader gives their starts, so document masks keep them apart and under cp they
split as any document does), and only the responses' targets count. A pair is thus never split
between micro-batches or ranks; the epochs, their order and the dp ranks' shares are
BatchLoader's, with pairs for samples. Each pair becomes the same row whatever the step or
layout, so a value computed once per pair (DPO's reference log-probabilities) stays true.
"""

from __future__ import annotations

import numpy as np

from megatronish.data.loader import BatchLoader, StepBatch, step_tensors
from megatronish.data.preference import RECORDS_FILE, record_name
from megatronish.data.sources import SPLIT_NAMES, DataPlan, TokenSource
from megatronish.errors import UserError


def is_preference(source: TokenSource) -> bool:
    """Whether the dataset holds preference pairs (`prepare --preference`)."""
    return bool((source.meta or {}).get("preference"))


def split_pairs(source: TokenSource, split: str) -> np.ndarray:
    """The dataset's indices of the pairs of `split` [n] (a pair's documents share a split)."""
    docs = np.flatnonzero(np.asarray(source.split) == SPLIT_NAMES.index(split))
    return docs[docs % 2 == 0] // 2


def pair_bounds(source: TokenSource, split: str, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(split_pairs of `split` [n], their token offsets int64 [n, 3]: chosen start, rejected
    start, end). UserError naming the first record whose pair has more than seq_len + 1
    tokens, or a split without pairs."""
    pairs = split_pairs(source, split)
    offsets = np.asarray(source.offsets, dtype=np.int64)
    bounds = np.stack([offsets[2 * pairs], offsets[2 * pairs + 1], offsets[2 * pairs + 2]], 1)
    lengths = bounds[:, 2] - bounds[:, 0]
    too_long = np.flatnonzero(lengths > seq_len + 1)
    if len(too_long):
        pair = int(pairs[too_long[0]])
        records = np.load(source.path / RECORDS_FILE)
        raise UserError(
            f"{source.path}: the pair of record {record_name(source.meta or {}, records, pair)} "
            f"has {int(lengths[too_long[0]])} tokens, more than train.seq_len + 1 = "
            f"{seq_len + 1} (a pair's two conversations share one sequence); raise "
            f"train.seq_len to at least {int(lengths.max()) - 1} or leave the record out"
        )
    if not len(pairs):
        raise UserError(f"{source.path}: the {split} split has no preference pairs")
    return pairs, bounds


class PairLoader(BatchLoader):
    """BatchLoader's interface over the pairs of a preference dataset (see the module
    docstring); last_pairs holds the dataset's indices of the pairs of this rank's last step,
    int64 [G / dp]."""

    def _count_samples(self) -> int:
        self.pairs, self._bounds = pair_bounds(self.source, self.split, self.seq_len)
        self.last_pairs = np.zeros(0, dtype=np.int64)
        return len(self.pairs)

    def next_step_batch(self) -> StepBatch:
        samples = self.ids_at(self.step_positions())
        self.consumed_samples += self.global_batch_size
        self.last_pairs = self.pairs[samples]
        return self.rows(samples)

    def of_split(self, split: str) -> PairLoader | None:
        """A loader of `split`'s pairs at this loader's sizes and ranks; None if it has none."""
        if not len(split_pairs(self.source, split)):
            return None
        sizes = (self.seq_len, self.global_batch_size, self.micro_batch_size)
        return PairLoader(self.source, split, *sizes, self.dp_rank, self.dp_size, self.seed)

    def rows(self, samples: np.ndarray) -> StepBatch:
        """The rows of these samples (pairs of the split), as a step's tensors: tokens
        [n / m, m, s + 1], the responses' targets as the loss mask, the documents' starts."""
        count, s = len(samples), self.seq_len
        tokens = np.full((count, s + 1), self.source.eot_id, dtype=np.int64)
        counted = np.zeros((count, s), dtype=bool)
        starts = np.zeros((count, s), dtype=bool)
        assert self.source.loss_mask is not None
        for row, (first, middle, end) in enumerate(self._bounds[samples]):
            length = int(end - first)
            tokens[row, :length] = self.source.tokens[first:end]
            counted[row, : length - 1] = self.source.loss_mask[first + 1 : end] == 1
            starts[row, middle - first] = True
            if length < s:
                starts[row, length] = True  # the padding: a document of its own
        return step_tensors(
            tokens, counted, starts, count // self.micro_batch_size, self.micro_batch_size
        )


def check_objective_data(objective: str, plan: DataPlan, seq_len: int) -> None:
    """UserError unless DPO (train.objective `objective`) trains on one preference dataset
    whose pairs fit seq_len, and next-token prediction on none."""
    preference = [source for source in plan.sources if is_preference(source)]
    if objective != "dpo":
        if preference:
            raise UserError(
                f"train.objective: {preference[0].path} holds preference pairs; set "
                "train.objective=dpo, or prepare its responses as SFT examples (--sft)"
            )
        return
    if plan.blended:
        raise UserError("data.blend: train.objective dpo trains on one preference dataset")
    if not preference:
        raise UserError(
            f"train.objective: dpo needs preference pairs; {plan.sources[0].path} has none "
            "(prepare them with `megatronish prepare --preference --input FILE.jsonl`)"
        )
    pair_bounds(preference[0], "train", seq_len)
