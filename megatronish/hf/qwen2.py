"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): the Llama block with biases on q, k and v alone
(model.qkv_bias; its q_proj.bias, k_proj.bias and v_proj.bias, split as the weights are). A
sliding window (use_sliding_window true) is refused until megatronish has one."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family

DEFAULTS = llama.ClassDefaults(kv_heads=32, max_positions=32768)
COMPONENTS = {"qkv_bias": True, "qk_norm": False}


def qwen_window_fields(config: ConfigJson) -> dict[str, Any]:
    """The Qwen families' window: sliding_window applies only under use_sliding_window."""
    return llama.sliding_window_fields(
        config, "use_sliding_window", config.get("use_sliding_window", False)
    )


def model_fields(config: ConfigJson) -> dict[str, Any]:
    return dict(
        llama.block_fields(config, "qwen2", DEFAULTS, COMPONENTS), **qwen_window_fields(config)
    )


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    return dict(
        llama.block_json(cfg, derived, "Qwen2ForCausalLM", "qwen2"),
        **llama.sliding_window_json(cfg, "use_sliding_window"),
    )


FAMILY = Family(
    architectures=("Qwen2ForCausalLM",),
    model_type="qwen2",
    arch="qwen2",
    components={**COMPONENTS, "experts": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=llama.to_hf,
    from_hf=llama.from_hf,
    buffers=llama.FAMILY.buffers,
)
