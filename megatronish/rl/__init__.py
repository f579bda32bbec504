"""The RL training backend: a Policy at any layout gives per-token log-probabilities and
entropies of packed variable-length sequences, takes policy-gradient steps (grpo, dr_grpo,
dapo, gspo) and streams its weights in Hugging Face names (docs/rl.md)."""

from megatronish.rl.policy import Policy

__all__ = ["Policy"]
