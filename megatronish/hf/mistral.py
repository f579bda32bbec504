"""Mistral (MistralForCausalLM): the Llama block with no biases, and its sliding_window (4096
when config.json leaves it out; null in Mistral 7B v0.2 / v0.3) in every block:
model.sliding_window with model.full_attention_layers 0."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family

DEFAULTS = llama.ClassDefaults(kv_heads=8, max_positions=4096 * 32)


def model_fields(config: ConfigJson) -> dict[str, Any]:
    window = config.get("sliding_window", 4096)
    return dict(
        llama.block_fields(config, "mistral", DEFAULTS, llama.PLAIN),
        **llama.window_fields(config, "sliding_window", window),
    )


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    return dict(
        llama.block_json(cfg, derived, "MistralForCausalLM", "mistral"),
        sliding_window=cfg.model.sliding_window,
    )


FAMILY = Family(
    name="Mistral",
    architectures=("MistralForCausalLM",),
    model_type="mistral",
    arch="mistral",
    components={**llama.PLAIN, **llama.EVERY_BLOCK_SLIDES, "experts": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=llama.to_hf,
    from_hf=llama.from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
