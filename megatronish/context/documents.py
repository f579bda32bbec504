"""Document masks (data.document_mask): where the documents of a packed sequence begin, as
Megatron's reset-attention-mask and reset-position-ids compute it from the tokens.

Legend: s the sequence (the model's inputs, tokens[..., :-1] of a loader sample), cp the
context-parallel degree. A document ends after each end-of-document token: the token that
follows one starts the next document, and the end-of-document token belongs to the document it
ends; where the dataset knows its records (an SFT dataset: the loader gives their starts), a
document is a record instead, whatever tokens it holds. Of each token, `segments` is the index
of its document within its sequence (0, 1, ..., non-decreasing along the sequence) and
`positions` its position within that document (0 at the first token of each document).
Attention never crosses a document: a query sees the keys of its own segment only (on top of
the causal mask), and positions restart at each document.

They are computed on the whole sequence before the zigzag split (megatronish.context.zigzag),
then split like the tokens, so a document that spans cp ranks is still one document and its
tokens keep their positions in it. Ring attention needs the segments of the other cp ranks'
shards too (the keys it receives): `shards` holds every cp rank's, so none travel the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.context.zigzag import shard_sequence


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of this cp rank's tokens [..., s / cp]: segments int32 and
    positions int64 [..., s / cp], and shards int32 [..., cp, s / cp], the segments of every cp
    rank's tokens (shards[..., cp_rank, :] is segments). Indexing a leading dimension indexes
    all three (documents[i]: micro-batch i of a step's [accum, micro, ...])."""

    segments: torch.Tensor
    positions: torch.Tensor
    shards: torch.Tensor

    def __getitem__(self, index) -> Documents:
        return Documents(self.segments[index], self.positions[index], self.shards[index])

    def shard(self, cp: int, cp_rank: int) -> Documents:
        """The documents of cp rank cp_rank's zigzag shard, from those of whole sequences."""
        dim = self.segments.dim() - 1
        shards = [shard_sequence(self.segments, cp, rank, dim) for rank in range(cp)]
        return Documents(
            shards[cp_rank],
            shard_sequence(self.positions, cp, cp_rank, dim),
            torch.stack(shards, dim=dim),
        )


def documents_of(inputs: torch.Tensor, eod_id: int) -> Documents:
    """The documents of whole sequences of token ids inputs [..., s] whose documents end with
    eod_id (shards: [..., 1, s], the one cp rank's)."""
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[..., 1:] = inputs[..., :-1] == eod_id  # a document starts after each end
    return documents_at(starts)


def documents_at(starts: torch.Tensor) -> Documents:
    """The documents of whole sequences [..., s] that begin where starts (bool [..., s], false
    at 0: the first token always begins one) is true: the records of a dataset that knows
    them (an SFT dataset, whose chat template may write the end-of-document token inside a
    record), or every token after an end-of-document token (documents_of)."""
    length = starts.shape[-1]
    segments = starts.cumsum(-1, dtype=torch.int32)
    index = torch.arange(length, device=starts.device).expand(starts.shape)
    first = torch.where(starts, index, 0).cummax(-1).values  # where each token's document starts
    return Documents(segments, index - first, segments.unsqueeze(-2))
