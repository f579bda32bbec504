"""Tensor-parallel building blocks. Each takes its process group explicitly (tp_group; None
means the default group, and with no process group at all they are the single-device ops)."""

from megatronish.layers.cross_entropy import vocab_parallel_cross_entropy
from megatronish.layers.embedding import VocabParallelEmbedding
from megatronish.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatronish.layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
