"""Checks of the model's position and attention components on their own: model.rope_scaling,
multi-head latent attention (model.attention, model.mla.*) and linear attention
(model.layer_types, model.linear_*), each failing with a UserError that names the key and what
is valid."""

from __future__ import annotations

import dataclasses

from megatronish.config.rules import VALID, divisors, require, require_degree
from megatronish.config.schema import ROPE_SCALING_KEYS, Config, RopeScalingConfig


def check_rope_scaling(cfg: Config) -> None:
    """model.rope_scaling: llama only, a known type with the keys that type reads (those of the
    other type left at their defaults), each in its range."""
    scaling, key = cfg.model.rope_scaling, "model.rope_scaling"
    if scaling is None:
        return
    require(
        cfg.model.components.rope,
        f"{key}: gpt2 has learned positions, no RoPE to scale (only with RoPE families)",
    )
    require(
        scaling.type is not None, f"{key}.type: missing; valid: {' | '.join(ROPE_SCALING_KEYS)}"
    )
    keys, defaults = ROPE_SCALING_KEYS[scaling.type], RopeScalingConfig()
    for field in dataclasses.fields(scaling):
        name = field.name
        if name != "type" and name not in keys:
            require(
                getattr(scaling, name) == getattr(defaults, name),
                f"{key}.{name}: not a key of type {scaling.type}; its keys: type, "
                + ", ".join(keys),
            )
    needed = ["factor"] + ([] if scaling.type == "linear" else ["original_max_position_embeddings"])
    needed += ["low_freq_factor", "high_freq_factor"] if scaling.type == "llama3" else []
    for name in needed:
        require(
            getattr(scaling, name) is not None,
            f"{key}.{name}: missing; type {scaling.type} needs {', '.join(needed)}",
        )
    require(scaling.factor >= 1, f"{key}.factor: {scaling.factor} is not valid; must be >= 1")
    if scaling.type == "linear":
        return
    original = scaling.original_max_position_embeddings
    require(
        original >= 1,
        f"{key}.original_max_position_embeddings: {original} is not valid; must be >= 1",
    )
    if scaling.type == "llama3":
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        require(low > 0, f"{key}.low_freq_factor: {low} is not valid; must be > 0")
        require(
            high > low,
            f"{key}.high_freq_factor: {high} is not valid; must be > low_freq_factor={low}",
        )
        return
    slow, fast = scaling.beta_slow, scaling.beta_fast
    require(slow > 0, f"{key}.beta_slow: {slow} is not valid; must be > 0")
    require(fast > slow, f"{key}.beta_fast: {fast} is not valid; must be > beta_slow={slow}")
    attention = scaling.attention_factor
    require(
        attention is None or attention > 0,
        f"{key}.attention_factor: {attention} is not valid; must be > 0, or null (from factor)",
    )
    for name in ("mscale", "mscale_all_dim"):
        value = getattr(scaling, name)
        require(
            value is None or value >= 0,
            f"{key}.{name}: {value} is not valid; must be >= 0, or null",
        )


MLA_REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_partial_rotary(cfg: Config) -> None:
    """model.partial_rotary_factor: in (0, 1], rotating an even number of each head's dims."""
    model = cfg.model
    factor = model.partial_rotary_factor
    key = "model.partial_rotary_factor"
    require(0 < factor <= 1, f"{key}: {factor} is not valid; must be > 0 and <= 1")
    if factor == 1:
        return
    require(
        model.components.rope and model.attention == "mha",
        f"{key}: {factor} needs RoPE attention of whole heads (model.attention mha, not gpt2); "
        "set it to 1",
    )
    head_dim = model.head_dim or model.d_model // model.n_head
    rotary = int(head_dim * factor)
    require(
        rotary >= 2 and rotary % 2 == 0,
        f"{key}: {factor} rotates {rotary} of head_dim {head_dim}; must rotate an even number "
        "of dims, at least 2",
    )


POSITIVE_SCORE_KEYS = (
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_local_base_freq",
)


def check_score_options(cfg: Config) -> None:
    """model.query_pre_attn_scalar, the soft-caps and model.rope_local_base_freq: > 0 or null;
    the attention's on multi-head attention (mha) only."""
    model = cfg.model
    for name in POSITIVE_SCORE_KEYS:
        value = getattr(model, name)
        require(
            value is None or value > 0,
            f"model.{name}: {value} is not valid; must be > 0, or null (off)",
        )
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "rope_local_base_freq"):
        require(
            getattr(model, name) is None or (model.components.rope and model.attention == "mha"),
            f"model.{name}: needs RoPE attention of whole heads (model.attention mha, not "
            "gpt2); set it to null",
        )


def check_attention(cfg: Config) -> None:
    """model.attention and model.mla: the latent sizes only with mla (all but q_lora_rank
    required then, each positive, the rotary dim even), mla only on the llama block, and none
    of the keys of the heads that mla replaces."""
    model = cfg.model
    mla = model.mla
    sizes = {f.name: getattr(mla, f.name) for f in dataclasses.fields(mla)}
    if model.attention == "mha":
        other = "" if model.arch == "deepseek_v3" else " (or model.arch=deepseek_v3)"
        for name, value in sizes.items():
            require(
                value is None,
                f"model.mla.{name}: {value} needs model.attention=mla (model.attention is mha, "
                f"model.arch {model.arch!r}); set model.attention=mla{other} or leave "
                f"model.mla.{name} unset",
            )
        return
    require(
        model.components.rope,
        "model.attention: mla needs the RoPE block; model.arch 'gpt2' has learned positions "
        "(valid: deepseek_v3, llama, ...)",
    )
    for name in MLA_REQUIRED:
        require(
            sizes[name] is not None,
            f"model.mla.{name}: missing; model.attention mla needs model.mla."
            + ", model.mla.".join(MLA_REQUIRED),
        )
    for name, value in sizes.items():
        require(
            value is None or value >= 1,
            f"model.mla.{name}: {value} is not valid; must be a positive integer"
            + (" or null (one query projection)" if name == "q_lora_rank" else ""),
        )
    rope = mla.qk_rope_head_dim
    require(rope % 2 == 0, f"model.mla.qk_rope_head_dim: {rope} is not valid; must be even (RoPE)")
    for key, value, unused in (
        ("n_kv_head", model.n_kv_head, model.n_kv_head in (None, model.n_head)),
        ("head_dim", model.head_dim, model.head_dim is None),
        ("qk_norm", model.qk_norm, not model.qk_norm),
        ("qkv_bias", model.qkv_bias, not model.qkv_bias),
    ):
        require(
            unused,
            f"model.{key}: {value} is not used by model.attention mla (its heads are "
            f"model.n_head queries over keys and values from the latent, sized by model.mla.*); "
            f"leave model.{key} unset",
        )


def check_layer_types(cfg: Config) -> None:
    """model.layer_types (one entry per block, sliding ones with a window, no
    model.full_attention_layers beside it) and, where a block runs linear attention, the
    model.linear_* sizes: positive, the value heads a multiple of the key heads."""
    model = cfg.model
    types = model.layer_types
    if types is None:
        return
    require(
        len(types) == model.n_layer,
        f"model.layer_types: {len(types)} entries is not valid; one per block, "
        f"model.n_layer={model.n_layer} of linear_attention | full_attention | "
        "sliding_attention",
    )
    require(
        "sliding_attention" not in types or model.sliding_window is not None,
        "model.layer_types: sliding_attention needs model.sliding_window (the positions a "
        "query of those blocks sees); set model.sliding_window",
    )
    require(
        model.full_attention_layers == 0,
        f"model.full_attention_layers: {model.full_attention_layers} is not used with "
        "model.layer_types (which names each block's kind); set it to 0",
    )
    if "linear_attention" not in types:
        return
    kernel = model.linear_conv_kernel_dim
    require(kernel >= 1, f"model.linear_conv_kernel_dim: {kernel} is not valid; must be >= 1")
    for name in ("key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads"):
        value = getattr(model, f"linear_{name}")
        require(value >= 1, f"model.linear_{name}: {value} is not valid; must be >= 1")
    keys, values = model.linear_num_key_heads, model.linear_num_value_heads
    require(
        values % keys == 0,
        f"model.linear_num_value_heads: {values} is not valid; must be a multiple of "
        f"model.linear_num_key_heads={keys}",
    )


def check_linear_heads_split(cfg: Config) -> None:
    """The linear-attention key heads (so their multiple, the value heads) split over
    parallel.tp, where a block runs linear attention (with the derived checks, so the tp it
    suggests passes the others: model.n_head's split too)."""
    model, tp = cfg.model, cfg.parallel.tp
    if "linear_attention" not in (model.layer_types or ()):
        return
    keys = model.linear_num_key_heads
    require_degree(
        keys % tp == 0,
        f"model.linear_num_key_heads: {keys} is not divisible by parallel.tp={tp}; valid tp: "
        f"{VALID}",
        "parallel.tp",
        divisors(keys),
    )
