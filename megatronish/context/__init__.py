"""Context parallelism: every sequence split over the ranks of a cp group (zigzag chunks), with
ring attention passing keys and values around the group; and the documents of packed
sequences (document masks), split the same way."""

from megatronish.context.documents import Documents, documents_at, documents_of
from megatronish.context.ring import Ring, RingCounter, ring_attention
from megatronish.context.zigzag import shard_sequence, split_batch, zigzag_positions

__all__ = [
    "Documents",
    "Ring",
    "RingCounter",
    "documents_at",
    "documents_of",
    "ring_attention",
    "shard_sequence",
    "split_batch",
    "zigzag_positions",
]
