"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): the Llama block with biases on q, k and v alone
(model.qkv_bias; its q_proj.bias, k_proj.bias and v_proj.bias, split as the weights are), and
with use_sliding_window a window in the blocks from max_window_layers on (model.sliding_window,
model.full_attention_layers), which Qwen3 and Qwen3-MoE share."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family

DEFAULTS = llama.ClassDefaults(kv_heads=32, max_positions=32768)
COMPONENTS = {"qkv_bias": True, "qk_norm": False}


def qwen_window_fields(config: ConfigJson) -> dict[str, Any]:
    """The Qwen families' window, as transformers reads it: sliding_window applies only under
    use_sliding_window, in the blocks that config.json's layer_types marks sliding_attention,
    or without layer_types in those from max_window_layers on; a pattern other than full
    blocks first, then sliding ones, is refused."""
    n_layer = config.need("num_hidden_layers")
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    types = config.get("layer_types")
    if types is None:
        first = config.get("max_window_layers", 28) if window is not None else n_layer
        types = ["full_attention"] * min(first, n_layer)
        types += ["sliding_attention"] * (n_layer - len(types))
    full = types.count("full_attention")
    if types != ["full_attention"] * full + ["sliding_attention"] * (n_layer - full):
        raise config.refuse(
            f"layer_types {types!r} is not supported; supported: {n_layer} entries, "
            "full_attention blocks first, then sliding_attention ones"
        )
    if window is None or full == n_layer:
        return llama.window_fields(config, "sliding_window", None)
    return llama.window_fields(config, "sliding_window", window, full)


def qwen_window_json(cfg: Config) -> dict[str, Any]:
    """config.json's window keys of our model: the inverse of qwen_window_fields."""
    model = cfg.model
    window, n_layer = model.sliding_window, model.n_layer
    full = n_layer if window is None else model.full_attention_layers
    types = ["full_attention"] * full + ["sliding_attention"] * (n_layer - full)
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": full,
        "layer_types": types,
    }


def model_fields(config: ConfigJson) -> dict[str, Any]:
    return dict(
        llama.block_fields(config, "qwen2", DEFAULTS, COMPONENTS), **qwen_window_fields(config)
    )


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    return dict(
        llama.block_json(cfg, derived, "Qwen2ForCausalLM", "qwen2"),
        **qwen_window_json(cfg),
    )


FAMILY = Family(
    name="Qwen2/2.5",
    architectures=("Qwen2ForCausalLM",),
    model_type="qwen2",
    arch="qwen2",
    components={**COMPONENTS, "experts": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=llama.to_hf,
    from_hf=llama.from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
