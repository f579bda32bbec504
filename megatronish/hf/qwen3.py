"""Qwen3 (Qwen3ForCausalLM): the Llama block with an RMSNorm of each head's query and key
(model.qk_norm; its self_attn.q_norm and k_norm) and a head_dim of its own (128 when config.json
leaves it out). attention_bias (a bias on every projection) is refused; its window is Qwen2's."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family
from megatronish.hf.qwen2 import qwen_window_fields, qwen_window_json

DEFAULTS = llama.ClassDefaults(kv_heads=32, head_dim=128, max_positions=32768)
COMPONENTS = {"qkv_bias": False, "qk_norm": True}


def qwen3_fields(
    config: ConfigJson, arch: str, defaults: llama.ClassDefaults, window=qwen_window_fields
) -> dict:
    """Our model.* settings of Qwen3's attention, which Qwen3-MoE shares (dense MLPs), with the
    window `window` reads."""
    llama.refuse_biases(config, "attention_bias")
    return dict(llama.block_fields(config, arch, defaults, COMPONENTS), **window(config))


def model_fields(config: ConfigJson) -> dict[str, Any]:
    return qwen3_fields(config, "qwen3", DEFAULTS)


def qwen3_json(
    cfg: Config, derived: Derived, architecture: str, model_type: str, window=qwen_window_json
) -> dict:
    """The config.json keys of Qwen3's attention, which Qwen3-MoE shares, with the window keys
    `window` writes."""
    return dict(
        llama.block_json(cfg, derived, architecture, model_type),
        attention_bias=False,
        **window(cfg),
    )


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    return qwen3_json(cfg, derived, "Qwen3ForCausalLM", "qwen3")


FAMILY = Family(
    name="Qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_type="qwen3",
    arch="qwen3",
    components={**COMPONENTS, "experts": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=llama.to_hf,
    from_hf=llama.from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
