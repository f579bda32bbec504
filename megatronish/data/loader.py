"""The batch loader: deterministic, data-parallel-sharded batches from a memory-mapped dataset.

Legend: G global batch size (samples per optimizer step, all dp ranks), m micro-batch size,
dp data-parallel degree, accum = G / (m * dp) micro-batches per step, s seq_len.

A split's documents (each with its end-of-text token) are concatenated, in document order,
into one virtual token stream of length L. Sample i is stream[i*s : i*s + s + 1]: windows that
start at multiples of s and take one token more, so inputs and targets shift by one. There are
N = (L - 1) // s samples. Epoch e visits them in the order of a permutation seeded by
(seed, e); the samples of all epochs, in order, form one global sequence, and step k takes the
k-th run of G of them, crossing into the next epoch's order when an epoch runs out. dp rank d
takes the contiguous slice [d*G/dp, (d+1)*G/dp) of a step's samples, so the concatenation of
the dp ranks' slices in rank order is the same global batch at every dp, and every tp rank of
one dp group (same dp_rank) gets the same batch.

Loss masks: when the dataset has one (SFT) or eod_mask_loss is set, next_masked_step() also
gives, aligned with the targets (the samples' tokens 1..s), whether each target counts in the
loss: the dataset's mask of that token (all ones without one), and with eod_mask_loss not where
the input is the end-of-text token, so no target is predicted across a document boundary (as
Megatron's --eod-mask-loss, which masks the positions whose input is the end-of-document id).

Documents (data.document_mask): a dataset whose records are its documents (an SFT dataset,
whose chat template may write the end-of-text token inside a conversation) gives, with
next_step_batch(), where its records start among the inputs; any other is cut into documents
after each end-of-text token (megatronish.context.documents).

The documents come through a TokenSource (sources.py): a prepared directory or a Megatron
prefix read in place; a blend of several is blend.py's BlendLoader, built on this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatronish.data.sources import SPLIT_NAMES, TokenSource, open_prepared
from megatronish.errors import UserError

if TYPE_CHECKING:
    import torch

STATE_VERSION = 1
# Keys of a saved state that must match the loader it is loaded into.
_MATCHING_KEYS = ("split", "seq_len", "global_batch_size", "seed", "dataset_sha256", "n_samples")


@dataclass(frozen=True)
class StepBatch:
    """A dp rank's share of a global batch: tokens int64 [accum, m, s + 1]; loss_mask bool
    [accum, m, s], whether each target counts (None: every one does); starts bool
    [accum, m, s], where a record of the dataset starts among the inputs (never at 0; None:
    documents end after each end-of-text token)."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor | None
    starts: torch.Tensor | None


def step_tensors(
    tokens: np.ndarray,
    mask: np.ndarray | None,
    starts: np.ndarray | None,
    accum: int,
    micro_batch_size: int,
) -> StepBatch:
    """A dp rank's samples [share, s + 1], their targets' mask and their record starts
    [share, s] (or None) as the tensors of a step."""
    import torch

    shape = (accum, micro_batch_size, -1)
    tensors = [None if a is None else torch.from_numpy(a.reshape(shape)) for a in (mask, starts)]
    return StepBatch(torch.from_numpy(tokens.reshape(shape)), *tensors)


class BatchLoader:
    """Batches of one split for one dp rank. next_step() returns torch.int64
    [accum, micro_batch_size, seq_len + 1]; a model takes [..., :-1] as input and [..., 1:] as
    target; next_masked_step() returns them with their targets' loss mask (masks_loss: whether
    there is one). The dataset is validated (every token against the vocabulary) at
    construction.

    state_dict() counts consumed global samples, so a run resumed from it sees exactly the
    batches an uninterrupted run would, also at another dp_size or micro_batch_size; a state
    from another dataset, split, seed, seq_len or global batch size is a UserError."""

    def __init__(
        self,
        dataset_dir: str | Path | TokenSource,
        split: str,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        eod_mask_loss: bool = False,
    ) -> None:
        if split not in SPLIT_NAMES:
            raise UserError(f"data split {split!r}: must be one of {', '.join(SPLIT_NAMES)}")
        if seq_len < 1 or micro_batch_size < 1 or dp_size < 1 or global_batch_size < 1:
            raise UserError(
                f"seq_len {seq_len}, micro_batch_size {micro_batch_size}, global_batch_size "
                f"{global_batch_size} and dp_size {dp_size} must all be positive"
            )
        if global_batch_size % (micro_batch_size * dp_size):
            raise UserError(
                f"train.global_batch_size {global_batch_size} must be a multiple of "
                f"train.micro_batch_size {micro_batch_size} x dp {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank {dp_rank}: must be in [0, {dp_size})")
        source = dataset_dir if isinstance(dataset_dir, TokenSource) else None
        self.source = source or open_prepared(dataset_dir)
        self.dataset_dir = self.source.path
        self.split = split
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.accum = global_batch_size // (micro_batch_size * dp_size)
        self.meta = self.source.meta
        self._tokens = self.source.tokens
        self.eod_mask_loss = eod_mask_loss
        self.masks_loss = self.source.loss_mask is not None or eod_mask_loss
        self.knows_records = self.source.records_are_documents  # next_step_batch's starts
        self._build_runs()
        self.n_samples = self._count_samples()
        self.consumed_samples = 0
        self.seed_key = [seed]  # a blend gives each dataset its own: [seed, index]
        self._permutations: dict[int, np.ndarray] = {}

    def _count_samples(self) -> int:
        """N, the samples of the split (at least one, else a UserError)."""
        n_samples = (self.stream_len - 1) // self.seq_len
        if n_samples < 1:
            what = "is empty" if self.stream_len == 0 else f"has only {self.stream_len} tokens"
            raise UserError(
                f"{self.dataset_dir}: the {self.split} split {what}, fewer than one sample of "
                f"seq_len + 1 = {self.seq_len + 1} tokens; use a smaller train.seq_len or more "
                "data"
            )
        return n_samples

    def _build_runs(self) -> None:
        """Maximal runs of consecutive documents of this split: file ranges and where each
        starts in the virtual stream."""
        offsets, flags = self.source.offsets, self.source.split
        chosen = np.flatnonzero(np.asarray(flags) == SPLIT_NAMES.index(self.split))
        starts = np.asarray(offsets[chosen], dtype=np.int64)
        ends = np.asarray(offsets[chosen + 1], dtype=np.int64)
        doc_lengths = ends - starts
        self._doc_stream_start = np.cumsum(doc_lengths) - doc_lengths  # each document's
        if len(chosen):
            breaks = starts[1:] != ends[:-1]
            starts = starts[np.concatenate(([True], breaks))]
            ends = ends[np.concatenate((breaks, [True]))]
        lengths = ends - starts
        self._run_file_start = starts
        self._run_length = lengths
        self._run_stream_start = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        self.stream_len = int(lengths.sum())

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.n_samples

    @property
    def eod_id(self) -> int:
        """The token id that ends every document of the dataset (data.document_mask)."""
        return self.source.eot_id

    def _permutation(self, epoch: int) -> np.ndarray:
        order = self._permutations.get(epoch)
        if order is None:
            rng = np.random.default_rng([*self.seed_key, epoch])
            order = rng.permutation(self.n_samples)
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = order
        return order

    def sample_ids(self, first: int, count: int) -> np.ndarray:
        """Sample indices (into the split's N windows) at global positions first..first+count."""
        return self.ids_at(np.arange(first, first + count, dtype=np.int64))

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices (into the split's N windows) at these global positions."""
        count = len(positions)
        epochs = positions // self.n_samples
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask] % self.n_samples]
        return out

    def _read_window(self, array: np.ndarray, stream_start: int, out: np.ndarray) -> None:
        """Copies the stream's stream_start : stream_start + len(out) of `array` (the tokens or
        the loss mask, [n_tokens]) into out, across runs."""
        run = int(np.searchsorted(self._run_stream_start, stream_start, side="right")) - 1
        filled = 0
        while filled < len(out):
            offset = stream_start + filled - int(self._run_stream_start[run])
            take = min(len(out) - filled, int(self._run_length[run]) - offset)
            begin = int(self._run_file_start[run]) + offset
            out[filled : filled + take] = array[begin : begin + take]
            filled += take
            run += 1

    def read_samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The samples at these global positions, int64 [len(positions), s + 1], and the loss
        mask of their targets, bool [len(positions), s] (None unless masks_loss)."""
        samples = self.ids_at(positions)
        batch = np.empty((len(positions), self.seq_len + 1), dtype=np.int64)
        for row, sample in enumerate(samples):
            self._read_window(self._tokens, int(sample) * self.seq_len, batch[row])
        if not self.masks_loss:
            return batch, None
        counted = np.ones((len(positions), self.seq_len), dtype=bool)
        if self.source.loss_mask is not None:
            for row, sample in enumerate(samples):
                self._read_window(
                    self.source.loss_mask, int(sample) * self.seq_len + 1, counted[row]
                )
        if self.eod_mask_loss:
            counted &= batch[:, :-1] != self.source.eot_id
        return batch, counted

    def read_starts(self, positions: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """Where a document starts among the inputs of the samples at these global positions,
        bool [len(positions), s], never at 0 (batch: their tokens, from read_samples): at the
        first token of each record of a dataset whose records are its documents
        (TokenSource.records_are_documents), else after each end-of-text token."""
        starts = np.zeros((len(positions), self.seq_len), dtype=bool)
        if not self.source.records_are_documents:
            starts[:, 1:] = batch[:, :-2] == self.source.eot_id
            return starts
        for row, sample in enumerate(self.ids_at(positions)):
            first = int(sample) * self.seq_len
            within = np.searchsorted(self._doc_stream_start, [first + 1, first + self.seq_len])
            starts[row, self._doc_stream_start[slice(*within)] - first] = True
        return starts

    def next_step(self) -> torch.Tensor:
        """This dp rank's share of the next global batch: int64 [accum, m, s + 1]."""
        return self.next_step_batch().tokens

    def next_masked_step(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """next_step()'s batch and its targets' loss mask, bool [accum, m, s] (None when every
        target counts: masks_loss is false)."""
        step = self.next_step_batch()
        return step.tokens, step.loss_mask

    def next_step_batch(self) -> StepBatch:
        """next_masked_step()'s batch and mask, with the record starts of a dataset whose
        records are its documents."""
        positions = self.step_positions()
        batch, mask = self.read_samples(positions)
        starts = self.read_starts(positions, batch) if self.knows_records else None
        self.consumed_samples += self.global_batch_size
        return step_tensors(batch, mask, starts, self.accum, self.micro_batch_size)

    def step_positions(self) -> np.ndarray:
        """The global positions of this dp rank's share of the next global batch, int64."""
        share = self.global_batch_size // self.dp_size
        first = self.consumed_samples + self.dp_rank * share
        return np.arange(first, first + share, dtype=np.int64)

    def reset(self) -> None:
        """Back to the first sample of epoch 0 (evaluation runs the same batches every time)."""
        self.consumed_samples = 0

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position and the settings a resumed loader must share."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "epoch": self.epoch,
            "position": self.consumed_samples % self.n_samples,
            "consumed_samples": self.consumed_samples,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "n_samples": self.n_samples,
            "dataset_sha256": self.source.sha256,
            "dataset_dir": str(self.dataset_dir.resolve()),
            "dp_size": self.dp_size,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a state_dict(); dp_size and micro_batch_size may differ."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise UserError(f"data loader state: version {state.get('version')!r} is not supported")
        for key in _MATCHING_KEYS:
            mine = getattr(self, key) if key != "dataset_sha256" else self.source.sha256
            if state.get(key) != mine:
                what = "dataset (sha256 of tokens.bin)" if key == "dataset_sha256" else key
                raise UserError(
                    f"data loader state: {what} is {state.get(key)!r} in the checkpoint but "
                    f"{mine!r} now; resume with the same {what} or start a new run"
                )
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError):
            raise UserError("data loader state: needs integer 'epoch' and 'position'") from None
        if not 0 <= position < self.n_samples or epoch < 0:
            raise UserError(f"data loader state: epoch {epoch} position {position} out of range")
        self.consumed_samples = epoch * self.n_samples + position
