"""Variable-length sequences packed by a token budget into micro-batches of one row each, with
document masks instead of padding (megatronish.context.documents).

Legend: n_i the length of sequence i, L a row's length (the sum of its sequences' lengths,
rounded up to `multiple`: the few filler tokens that cp's zigzag split and sequence parallelism
need, one document of their own that nothing reads), cp the context-parallel degree.

A sequence is whole in one row, so its attention and positions are those of the sequence
alone. In a row, position j of sequence i (at offset o) predicts token j + 1 of it: the row's
targets are the next tokens within each sequence, -100 at each sequence's last token and at
the filler. Log-probabilities of sequence i are the row's per-token values at o .. o + n_i - 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.context import Documents
from megatronish.context.zigzag import shard_sequence
from megatronish.layers.cross_entropy import IGNORE_INDEX


@dataclass(frozen=True)
class Row:
    """One packed micro-batch: which sequences, where each starts, and the row's length."""

    members: tuple[int, ...]
    """Indices of the sequences in the caller's list, in row order."""
    offsets: tuple[int, ...]
    """The row position of each member's first token."""
    length: int
    """L: the members' tokens plus the filler."""


def pack(lengths: list[int], budget: int, multiple: int = 1) -> list[Row]:
    """Rows of at most `budget` tokens (a longer sequence alone in its row), first-fit in order
    of decreasing length, each row's length a multiple of `multiple`."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for index in order:
        for b, total in enumerate(used):
            if total + lengths[index] <= budget:
                bins[b].append(index)
                used[b] += lengths[index]
                break
        else:
            bins.append([index])
            used.append(lengths[index])
    rows = []
    for members in bins:
        members.sort()  # the caller's order within a row
        offsets, at = [], 0
        for index in members:
            offsets.append(at)
            at += lengths[index]
        rows.append(Row(tuple(members), tuple(offsets), -(-at // multiple) * multiple))
    return rows


def row_tensors(
    row: Row, seqs: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, Documents]:
    """The whole row's tokens and targets [1, L] (int64) and its documents (one per member,
    the filler one more)."""
    tokens = torch.zeros(row.length, dtype=torch.int64)
    targets = torch.full((row.length,), IGNORE_INDEX, dtype=torch.int64)
    segments = torch.full((row.length,), len(row.members), dtype=torch.int32)
    positions = torch.arange(row.length, dtype=torch.int64)
    for segment, (index, offset) in enumerate(zip(row.members, row.offsets, strict=True)):
        seq = torch.tensor(seqs[index], dtype=torch.int64)
        end = offset + len(seq)
        tokens[offset:end] = seq
        targets[offset : end - 1] = seq[1:]
        segments[offset:end] = segment
        positions[offset:end] -= offset
    filler = int(sum(len(seqs[i]) for i in row.members))
    positions[filler:] -= filler
    documents = Documents(segments[None], positions[None], segments[None, None])
    return tokens[None].to(device), targets[None].to(device), _on(documents, device)


def per_token(row: Row, values: list[torch.Tensor], length: int) -> torch.Tensor:
    """A row's per-token tensor [1, L] (fp64: weights and references keep their precision
    until the loss) from one tensor per member of n_i - 1 values, at the positions whose
    targets they belong to; 0 elsewhere."""
    out = torch.zeros(length, dtype=torch.float64)
    for value, offset in zip(values, row.offsets, strict=True):
        out[offset : offset + len(value)] = value.to(torch.float64)
    return out[None]


def split_row(row: Row, values: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Per member, the row's values [L] at its positions that have targets (n_i - 1 each);
    lengths: every sequence's n_i, by the caller's index."""
    return [
        values[offset : offset + lengths[index] - 1]
        for index, offset in zip(row.members, row.offsets, strict=True)
    ]


def shard_row(x: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's zigzag shard of a whole row's tensor [1, L, ...]."""
    return shard_sequence(x, cp, cp_rank, dim=1)


def _on(documents: Documents, device: torch.device) -> Documents:
    return Documents(*(t.to(device) for t in vars(documents).values()))
