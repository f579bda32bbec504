"""Blends: several datasets mixed by sampling proportion (data.blend), and the loader for them.

Global sample i of the run comes from dataset k when x_i = frac(phase + (i + 1) * alpha) falls in
k's interval of the cumulative weights, alpha = (sqrt(5) - 1) / 2 and phase drawn from the seed.
This Weyl sequence is equidistributed with low discrepancy, so after n samples every dataset's
share is within about log(n) / n of its weight, whatever the datasets' sizes; it is random-access
(a resumed run recomputes where it stands) and the same at every layout. The j-th sample taken
from dataset k is its own loader's j-th (an epoch-permuted sequence seeded by (seed, k)), so a
small dataset repeats epochs while a large one is still in its first.

The layout: every rank computes the same global batch of G samples for a step, then takes its
dp rank's contiguous slice of it, as BatchLoader does.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from megatronish.data.loader import BatchLoader, StepBatch, step_tensors
from megatronish.data.pairs import PairLoader, is_preference
from megatronish.data.sources import DataPlan, TokenSource, shared_eod_id
from megatronish.errors import UserError

if TYPE_CHECKING:
    import torch

    from megatronish.config import Config

ALPHA = (math.sqrt(5.0) - 1.0) / 2.0
STATE_KIND = "blend"
_PHASE_STREAM = 0xB1E5D  # the seed's stream for the phase
_COUNT_CHUNK = 1 << 22  # positions counted at a time when finding where a resumed run stands


def assign(positions: np.ndarray, bounds: np.ndarray, phase: float) -> np.ndarray:
    """The dataset index of each global sample position (bounds: cumulative weights,
    normalized, without the leading 0)."""
    x = np.mod(phase + (positions.astype(np.float64) + 1.0) * ALPHA, 1.0)
    return np.minimum(np.searchsorted(bounds, x, side="right"), len(bounds) - 1)


def open_loader(
    cfg: Config, data: DataPlan, split: str, dp_rank: int = 0, dp_size: int = 1
) -> BatchLoader | BlendLoader:
    """The loader of `split` over a run's datasets for dp rank dp_rank of dp_size, at cfg's
    train.seq_len, batch sizes and seed and its data.eod_mask_loss: a BlendLoader for a blend,
    else a BatchLoader. Training and `eval` read their batches through it."""
    train = cfg.train
    sizes = dict(
        seq_len=train.seq_len,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=train.seed,
        eod_mask_loss=cfg.data.eod_mask_loss,
    )
    if data.blended:
        return BlendLoader(data.sources, data.weights, split, **sizes)
    kind = PairLoader if is_preference(data.sources[0]) else BatchLoader
    return kind(data.sources[0], split, **sizes)


class BlendLoader:
    """BatchLoader's interface (next_step, next_masked_step, next_step_batch, masks_loss,
    knows_records, reset, state_dict, load_state_dict) over a blend of datasets. Only the
    datasets with documents in `split` take part (weights renormalized). The blend masks the
    loss when one of them does; every target of a dataset without a mask counts (but, with
    eod_mask_loss, the one whose input is the end-of-text)."""

    def __init__(
        self,
        sources: list[TokenSource],
        weights: list[float],
        split: str,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        eod_mask_loss: bool = False,
    ) -> None:
        chosen = [i for i, s in enumerate(sources) if s.docs_in(split)]
        if not chosen:
            raise UserError(f"data.blend: no dataset of the blend has {split} documents")
        self.chosen = chosen  # indices into `sources` of the datasets taking part
        self.parts: list[BatchLoader] = []
        for index in chosen:
            part = BatchLoader(
                sources[index],
                split,
                seq_len,
                global_batch_size,
                micro_batch_size,
                0,
                1,
                seed,
                eod_mask_loss,
            )
            part.seed_key = [seed, index]
            self.parts.append(part)
        self.masks_loss = any(part.masks_loss for part in self.parts)
        self.knows_records = any(part.knows_records for part in self.parts)
        total = sum(weights[i] for i in chosen)
        self.weights = [weights[i] / total for i in chosen]
        self.bounds = np.cumsum(self.weights)
        self.phase = float(np.random.default_rng([seed, _PHASE_STREAM]).random())
        if global_batch_size % (micro_batch_size * dp_size):
            raise UserError(
                f"train.global_batch_size {global_batch_size} must be a multiple of "
                f"train.micro_batch_size {micro_batch_size} x dp {dp_size}"
            )
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.accum = global_batch_size // (micro_batch_size * dp_size)
        self.consumed_samples = 0
        self._counts = np.zeros(len(self.parts), dtype=np.int64)  # at consumed_samples
        digest = hashlib.sha256()
        for part, weight in zip(self.parts, self.weights, strict=True):
            digest.update(f"{part.source.sha256} {weight!r}\n".encode())
        self.blend_sha256 = digest.hexdigest()
        self._eod_id: int | None = None

    @property
    def eod_id(self) -> int:
        """The token id that ends every document of the blended datasets (one for all)."""
        if self._eod_id is None:
            self._eod_id = shared_eod_id([part.source for part in self.parts])
        return self._eod_id

    def counts_before(self, position: int) -> np.ndarray:
        """int64 [datasets]: samples each dataset gives to global positions [0, position)."""
        counts = np.zeros(len(self.parts), dtype=np.int64)
        for start in range(0, position, _COUNT_CHUNK):
            chunk = np.arange(start, min(position, start + _COUNT_CHUNK), dtype=np.int64)
            counts += np.bincount(assign(chunk, self.bounds, self.phase), minlength=len(counts))
        return counts

    def next_step(self) -> torch.Tensor:
        """This dp rank's share of the next global batch: int64 [accum, m, s + 1]."""
        return self.next_step_batch().tokens

    def next_masked_step(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """next_step()'s batch and its targets' loss mask, bool [accum, m, s] (None when every
        target counts)."""
        step = self.next_step_batch()
        return step.tokens, step.loss_mask

    def next_step_batch(self) -> StepBatch:
        """next_masked_step()'s batch and mask, with the document starts of every sample when a
        dataset of the blend knows its records (BatchLoader.read_starts)."""
        first, size = self.consumed_samples, self.global_batch_size
        which = assign(np.arange(first, first + size, dtype=np.int64), self.bounds, self.phase)
        index = np.empty(size, dtype=np.int64)  # each sample's place in its dataset's sequence
        for k in range(len(self.parts)):
            mine = which == k
            index[mine] = self._counts[k] + np.arange(int(mine.sum()))
        share = size // self.dp_size
        rows = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        batch = np.empty((share, self.seq_len + 1), dtype=np.int64)
        mask = np.ones((share, self.seq_len), dtype=bool) if self.masks_loss else None
        starts = np.zeros((share, self.seq_len), dtype=bool) if self.knows_records else None
        for k, part in enumerate(self.parts):
            mine = which[rows] == k
            if mine.any():
                batch[mine], counted = part.read_samples(index[rows][mine])
                if counted is not None:
                    mask[mine] = counted
                if starts is not None:
                    starts[mine] = part.read_starts(index[rows][mine], batch[mine])
        self._counts += np.bincount(which, minlength=len(self.parts))
        self.consumed_samples += size
        return step_tensors(batch, mask, starts, self.accum, self.micro_batch_size)

    def reset(self) -> None:
        self.consumed_samples = 0
        self._counts[:] = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "split": self.split,
            "consumed_samples": self.consumed_samples,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "blend_sha256": self.blend_sha256,
            "datasets": [str(p.source.path) for p in self.parts],
            "weights": self.weights,
            "dp_size": self.dp_size,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a state_dict() of the same blend; dp_size and micro_batch_size may
        differ."""
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
            raise UserError(
                "data loader state: the checkpoint was not saved by a run of this blend "
                "(data.blend); resume with the same data settings or start a new run"
            )
        for key in ("split", "seq_len", "global_batch_size", "seed", "blend_sha256"):
            if state.get(key) != getattr(self, key):
                what = "blend (datasets and weights)" if key == "blend_sha256" else key
                raise UserError(
                    f"data loader state: {what} differs between the checkpoint and this run; "
                    f"resume with the same {what} or start a new run"
                )
        consumed = state.get("consumed_samples")
        if not isinstance(consumed, int) or consumed < 0 or consumed % self.global_batch_size:
            raise UserError(f"data loader state: consumed_samples {consumed!r} is not valid")
        self.consumed_samples = consumed
        self._counts = self.counts_before(consumed)
