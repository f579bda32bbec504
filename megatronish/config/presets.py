"""model.arch as a preset: each family's defaults for the component keys, filled in where a
config leaves them unset. A new family is an entry here (and its Hugging Face mapping in
megatronish.hf), never a branch through the model."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from megatronish.config.components import (
    GEMMA3,
    GPT2,
    GPT_OSS,
    QWEN3_5,
    ROPE,
    AttentionKind,
    BlockComponents,
)

_QWEN = {"norm_eps": 1e-6, "rope_theta": 1e6}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "llama": {},
    "mistral": {},
    "qwen2": {**_QWEN, "qkv_bias": True},
    "qwen3": {**_QWEN, "qk_norm": True},
    "qwen3_moe": {
        **_QWEN,
        "qk_norm": True,
        "moe": {"router": "softmax_topk", "aux_loss_coef": 0.001, "z_loss_coef": 0.0},
    },
    "qwen3_5": {  # transformers' Qwen3_5TextConfig defaults
        "norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "qk_norm": True,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "tie_embeddings": False,
        "moe": {  # with model.moe.num_experts: Qwen3_5MoeTextConfig's experts
            "router": "softmax_topk",
            "aux_loss_coef": 0.001,
            "z_loss_coef": 0.0,
            "shared_expert": True,
            "shared_expert_gate": True,
        },
    },
    "gemma3": {  # transformers' Gemma3TextConfig defaults
        "norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "qk_norm": True,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
    },
    "deepseek_v3": {  # DeepSeek-V3's config.json (bias_update_speed: its paper's)
        "norm_eps": 1e-6,
        "attention": "mla",
        "mla": {
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
        },
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "moe": {
            "router": "sigmoid",
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "bias_update_speed": 0.001,
            "seq_aux_loss_coef": 0.001,
            "n_shared_experts": 1,
            "first_k_dense": 3,
            "aux_loss_coef": 0.0,
            "z_loss_coef": 0.0,
        },
    },
    "gpt_oss": {  # transformers' GptOssConfig defaults
        "norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "head_dim": 64,
        "tie_embeddings": False,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "moe": {"router": "topk_softmax", "aux_loss_coef": 0.0, "z_loss_coef": 0.0},
    },
}
"""model.* defaults of each model.arch (nested dicts for sub-sections such as model.moe)."""

FAMILY_BLOCKS: dict[str, BlockComponents] = {arch: ROPE for arch in PRESETS} | {
    "gpt2": GPT2,
    "qwen3_5": QWEN3_5,
    "gemma3": GEMMA3,
    "gpt_oss": GPT_OSS,
}
"""The components each model.arch builds its blocks from (megatronish.config.components)."""


@functools.cache
def components_of(arch: str, attention: AttentionKind, qkv_bias: bool) -> BlockComponents:
    """The components of model.arch's blocks, with model.attention's attention and, in a RoPE
    family, biases on the qkv projection where model.qkv_bias sets them (built once for each
    choice: the planner asks millions of times)."""
    base = FAMILY_BLOCKS[arch]
    if base.rope and qkv_bias and base.biases == "none":
        base = replace(base, biases="qkv")
    return replace(base, attention=attention)


def with_preset(model: Any, arch: str, attention: str | None = None) -> Any:
    """The model section `model` (a YAML mapping, or anything else, returned as it is for the
    loader to refuse) with the preset of `arch` filling the keys it does not set. The preset's
    model.mla sizes only where the attention resolves to mla (`attention`, the --set value if
    any, else the section's, else the preset's): deepseek_v3 with attention mha has no latent
    sizes to fill."""
    if not isinstance(model, dict):
        return model
    preset = PRESETS.get(arch, {})
    if (attention or model.get("attention") or preset.get("attention", "mha")) != "mla":
        preset = {key: value for key, value in preset.items() if key != "mla"}
    return _fill(dict(model), preset)


def _fill(section: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """section with `defaults` in the keys it leaves out, section by section. A key it sets is
    its own, an explicit null too (model.rope_scaling: null is no scaling, as --set gives it;
    model.moe: null and model.mla: null are the schema's empty sections, not the preset's)."""
    for key, value in defaults.items():
        if key not in section:
            section[key] = dict(value) if isinstance(value, dict) else value
        elif isinstance(value, dict) and isinstance(section[key], dict):
            section[key] = _fill(dict(section[key]), value)
    return section
