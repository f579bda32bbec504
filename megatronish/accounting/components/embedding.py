"""The token embedding and the positions (``BlockComponents.positions``): a learned table of
max_seq_len x d_model beside the token embedding, replicated over tp, or rotary positions that
attention applies to its queries and keys."""

from __future__ import annotations

from megatronish.config.schema import ModelConfig


def position_params(model: ModelConfig) -> int:
    """Parameters of the learned position table (replicated on every tp rank): 0 with rope."""
    return 0 if model.components.rope else model.max_seq_len * model.d_model


def parameters(model: ModelConfig, vocab: int) -> int:
    """Parameters of the token embedding over `vocab` rows (a tp rank's, or all) and the
    position table."""
    return vocab * model.d_model + position_params(model)


def rope_elements(model: ModelConfig, tokens: int, heads: int, kv: int, head_dim: int) -> int:
    """Elements the rotary embedding reads and writes forward on `tokens` tokens' queries and
    keys (read + write T (a + k) d), in ``rope_kernels`` kernels; 0 with learned positions."""
    return 2 * tokens * (heads + kv) * head_dim if model.components.rope else 0


def rope_kernels(model: ModelConfig) -> int:
    """Kernels of the rotary embedding forward: one on the queries, one on the keys."""
    return 2 if model.components.rope else 0
