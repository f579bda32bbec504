"""Gemma 3 (Gemma3ForCausalLM, the text model: Gemma3TextConfig, model_type gemma3_text).

Its blocks are the Llama block's with the components of the gemma3 preset: four norms per block
(input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
post_feedforward_layernorm: our norm1, attn_out_norm, norm2, mlp_out_norm), each scaling by
1 + weight (the tensors are copied as they are), q and k norms, GeGLU (gate_proj, up_proj,
down_proj with gelu_pytorch_tanh), the embeddings scaled by sqrt(hidden_size), the scores by
query_pre_attn_scalar^-0.5, and the output logits' soft-cap (final_logit_softcapping; the class
reads attn_logit_softcapping but its attention does not apply it, and neither does import).
layer_types marks each block full_attention or sliding_attention (through sliding_window);
rope_parameters holds one RoPE per kind: the global blocks' (rope_theta, with a linear scaling
in the published configs) and the local blocks' (our model.rope_local_base_freq, unscaled).
"""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived, attention_window
from megatronish.errors import UserError
from megatronish.hf import llama
from megatronish.hf.family import (
    ConfigJson,
    Family,
    Names,
    Tensors,
    copy_to_hf,
    merge_qkv,
    split_qkv,
    take_from_hf,
)

FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATION = "gelu_pytorch_tanh"
# Gemma3TextConfig's defaults where config.json leaves a key out
DEFAULTS = llama.ClassDefaults(kv_heads=4, head_dim=256, max_positions=131072, rope_theta=1e6)
LOCAL_THETA, PATTERN, WINDOW, SCALAR = 1e4, 6, 4096, 256
COMPONENTS = {"qkv_bias": False, "qk_norm": True}
ATTN_SOFTCAP = "attn_logit_softcapping"  # read by Gemma3TextConfig, not applied by its attention
SOFTCAPS = (ATTN_SOFTCAP, "final_logit_softcapping")

BLOCK: Names = (
    ("norm1.weight", "input_layernorm.weight"),
    ("attn_out_norm.weight", "post_attention_layernorm.weight"),
    ("norm2.weight", "pre_feedforward_layernorm.weight"),
    ("mlp_out_norm.weight", "post_feedforward_layernorm.weight"),
    ("attn.proj.weight", "self_attn.o_proj.weight"),
    *llama.QK_NORM,
    *llama.DENSE_MLP,
)


def layer_types_of(config: ConfigJson, n_layer: int) -> list[str]:
    """config.json's layer_types, or transformers' pattern without it (every
    sliding_window_pattern-th block full attention, the others sliding); a UserError for a
    list that is not n_layer entries of the two kinds."""
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", PATTERN)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer or set(types) - {FULL, SLIDING}:
        raise config.refuse(
            f"layer_types {types!r} is not supported; supported: num_hidden_layers={n_layer} "
            f"entries of {FULL} or {SLIDING}"
        )
    return types


def rope_of(config: ConfigJson) -> dict[str, Any]:
    """Our RoPE settings (rope_theta, rope_scaling, rope_local_base_freq) of config.json's
    per-kind rope_parameters, or of the older rope_theta, rope_scaling (the global blocks') and
    rope_local_base_freq; local blocks with a scaling of their own are refused unless it is the
    global one (then rope_local_base_freq is null: both kinds rotate alike)."""
    params = config.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full = params.get(FULL) or {}
        local = params.get(SLIDING) or {"rope_theta": LOCAL_THETA}
    else:
        full = dict(config.get("rope_scaling") or {}, rope_theta=config.get("rope_theta", 1e6))
        local = {"rope_theta": config.get("rope_local_base_freq", LOCAL_THETA)}
    extra = {"max_position_embeddings": config.get("max_position_embeddings")}
    fields = llama.rope_fields(ConfigJson({"rope_parameters": full, **extra}, config.path), 1e6)
    sliding = llama.rope_fields(ConfigJson({"rope_parameters": local, **extra}, config.path), 1e4)
    if sliding == fields and sliding["rope_scaling"] is not None:
        return dict(fields, rope_local_base_freq=None)
    if sliding["rope_scaling"] is not None:
        raise config.refuse(
            f"rope_parameters.{SLIDING} {local!r} is not supported; supported: the default "
            f"rope_type (a base of its own), or the {FULL} blocks' RoPE"
        )
    return dict(fields, rope_local_base_freq=sliding["rope_theta"])


def softcaps_of(config: ConfigJson) -> dict[str, Any]:
    """The output logits' soft-cap (null: none) and the attention's, null as Gemma3ForCausalLM
    runs (FAMILY.unapplied: import notes it); a UserError for either set to a value not > 0."""
    for key in SOFTCAPS:
        cap = config.get(key)
        number = isinstance(cap, int | float) and not isinstance(cap, bool)
        if cap is not None and not (number and cap > 0):
            raise config.refuse(f"{key} {cap!r} is not supported; supported: > 0 or null")
    return {ATTN_SOFTCAP: None, "final_logit_softcapping": config.get("final_logit_softcapping")}


def model_fields(config: ConfigJson) -> dict[str, Any]:
    """Our model.* settings of a Gemma3TextConfig config.json."""
    llama.refuse_biases(config, "attention_bias")
    act = config.get("hidden_activation", config.get("hidden_act", ACTIVATION))
    if act != ACTIVATION:
        raise config.refuse(f"hidden_activation {act!r} is not supported; supported: {ACTIVATION}")
    if config.get("use_bidirectional_attention"):
        raise config.refuse("use_bidirectional_attention true is not supported; supported: false")
    n_layer = config.need("num_hidden_layers")
    types = layer_types_of(config, n_layer)
    window = config.get("sliding_window", WINDOW) if SLIDING in types else None
    if SLIDING in types and window is None:
        raise config.refuse(
            f"sliding_window null is not supported with {SLIDING} in layer_types; supported: a "
            "positive integer (the positions a query sees, itself included)"
        )
    # the Llama block's sizes; the activation and RoPE are read here
    plain = {k: v for k, v in config.raw.items() if k not in ("rope_parameters", "rope_scaling")}
    plain = ConfigJson(dict(plain, hidden_act="silu"), config.path)
    fields = llama.block_fields(plain, "gemma3", DEFAULTS, COMPONENTS)
    return dict(
        fields,
        **rope_of(config),
        **llama.window_fields(config, "sliding_window", window),
        **softcaps_of(config),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        layer_types=types,
        query_pre_attn_scalar=config.get("query_pre_attn_scalar", SCALAR),
        partial_rotary_factor=1.0,
    )


def layer_types(cfg: Config) -> list[str]:
    """Each block's kind, as our model runs it (its window)."""
    model = cfg.model
    return [FULL if attention_window(model, i) is None else SLIDING for i in range(model.n_layer)]


def _whole(value: float | None) -> float | int | None:
    """A number as config.json writes it: an integer where it is one (Gemma3TextConfig types
    query_pre_attn_scalar as int)."""
    return int(value) if value is not None and float(value).is_integer() else value


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    """config.json's keys of our model as Gemma3ForCausalLM: the Llama block's, the activation,
    the per-kind rope_parameters and the score options."""
    model = cfg.model
    if model.attn_logit_softcapping is not None:
        raise UserError(
            f"model.attn_logit_softcapping={model.attn_logit_softcapping}: Gemma3ForCausalLM "
            "(export --format hf) does not apply it; set it to null to export"
        )
    out = llama.block_json(cfg, derived, "Gemma3ForCausalLM", "gemma3_text")
    for key in ("hidden_act", "rope_theta", "rope_scaling"):
        out.pop(key, None)
    full = out.pop("rope_parameters")
    local = full
    if model.rope_local_base_freq is not None:
        local = {"rope_type": "default", "rope_theta": model.rope_local_base_freq}
    scalar = model.query_pre_attn_scalar
    return dict(
        out,
        hidden_activation=ACTIVATION,
        attention_bias=False,
        layer_types=layer_types(cfg),
        sliding_window=model.sliding_window,
        rope_parameters={FULL: full, SLIDING: local},
        query_pre_attn_scalar=_whole(derived.head_dim if scalar is None else scalar),
        attn_logit_softcapping=None,
        final_logit_softcapping=model.final_logit_softcapping,
    )


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    heads = (cfg.model.n_head, derived.n_kv_head, derived.head_dim)
    out: Tensors = {"model.embed_tokens.weight": ours["tok_emb.weight"]}
    for i in range(cfg.model.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for name, part in zip(llama.QKV, split_qkv(ours[f"{src}attn.qkv.weight"], *heads)):
            out[f"{dst}{name}weight"] = part.contiguous()
        copy_to_hf(ours, out, BLOCK, src, dst)
    out["model.norm.weight"] = ours["norm_f.weight"]
    return out


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    heads = (fields["n_head"], fields["n_kv_head"], fields["head_dim"])
    ours: Tensors = {"tok_emb.weight": hf.pop("model.embed_tokens.weight")}
    for i in range(fields["n_layer"]):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        q, key, value = (hf.pop(f"{src}{name}weight") for name in llama.QKV)
        ours[f"{dst}attn.qkv.weight"] = merge_qkv(q, key, value, *heads)
        take_from_hf(hf, ours, BLOCK, src, dst)
    ours["norm_f.weight"] = hf.pop("model.norm.weight")
    return ours


FAMILY = Family(
    name="Gemma 3",
    architectures=("Gemma3ForCausalLM",),
    model_type="gemma3_text",
    arch="gemma3",
    components={**COMPONENTS, "experts": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=("rotary_emb.inv_freq", "embed_tokens.embed_scale"),
    training_only=llama.TRAINING_ONLY,
    unapplied=(ATTN_SOFTCAP,),
)
