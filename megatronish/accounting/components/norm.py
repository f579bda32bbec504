"""The norms of a block (model.norm: LayerNorm or RMSNorm over d_model), as
``ModelConfig.components`` places them: their parameters and their memory-bound passes."""

from __future__ import annotations

from megatronish.config.schema import ModelConfig

PER_BLOCK = {"pre": 2, "sandwich": 4}
"""Norms in one block by placement: pre, one before attention and one before the MLP; sandwich,
those and one after each (the final norm after the last block is the model's, ``weights``)."""


def weights(model: ModelConfig) -> int:
    """Parameters of one norm: weight and bias (layernorm) or weight, d_model each."""
    return model.components.norm_weights * model.d_model


def per_block(model: ModelConfig) -> int:
    """The norms one block runs."""
    return PER_BLOCK[model.components.norm_placement]


def block_parameters(model: ModelConfig) -> int:
    """Parameters of one block's norms (replicated over tp)."""
    return per_block(model) * weights(model)


def activations(model: ModelConfig) -> int:
    """What one block's norms keep for backward in 16-bit s b h: each its input (2), whole on
    every tp rank without sequence parallelism."""
    return per_block(model) * 2


def stream_elements(model: ModelConfig, tokens: int) -> int:
    """Elements one block's norms read and write forward over `tokens` tokens (read N h, write
    N h each): with ``per_block`` kernels."""
    return per_block(model) * 2 * tokens * model.d_model
