"""Context parallelism: every sequence split over the ranks of a cp group (zigzag chunks), with
ring attention passing keys and values around the group."""

from megatronish.context.ring import Ring, RingCounter, ring_attention
from megatronish.context.zigzag import shard_sequence, split_batch, zigzag_positions

__all__ = [
    "Ring",
    "RingCounter",
    "ring_attention",
    "shard_sequence",
    "split_batch",
    "zigzag_positions",
]
