"""Llama (LlamaForCausalLM), and the Llama block every other RoPE family shares: RoPE, RMSNorm,
SwiGLU, grouped-query attention.

HF Llama has separate q_proj [n d, h], k_proj and v_proj [k d, h] where our qkv is grouped by
kv head. It numbers query head j as ours does (its kv head is j // (n / k)), and our RoPE pairs
dims i and i + d/2 as its rotate_half does, so no row permutation beyond the grouping is needed.
The families differ in components, which the shared mapping takes from the model's settings:
q, k and v biases (Qwen2: q_proj.bias ...), split as the weights are; per-head q and k norms
(Qwen3: self_attn.q_norm / k_norm); and each block's MLP names, dense or experts (Mixtral,
Qwen3-MoE). config.json's keys are read with each class's own defaults (`ClassDefaults`), as
transformers fills them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatronish.config import Config, Derived, MoEConfig
from megatronish.config.schema import ROPE_SCALING_KEYS, RopeScalingConfig
from megatronish.errors import UserError
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

BLOCK = (
    ("norm1.weight", "input_layernorm.weight"),
    ("norm2.weight", "post_attention_layernorm.weight"),
    ("attn.proj.weight", "self_attn.o_proj.weight"),
)
QK_NORM = tuple((f"attn.{p}_norm.weight", f"self_attn.{p}_norm.weight") for p in "qk")
DENSE_MLP = tuple(
    (f"mlp.{part}.weight", f"mlp.{part}_proj.weight") for part in ("gate", "up", "down")
)
QKV = tuple(f"self_attn.{part}_proj." for part in "qkv")
PLAIN = {"qkv_bias": False, "qk_norm": False}  # Llama's attention: neither component
# A window in every block (Mistral, Mixtral): no blocks of full attention before it.
EVERY_BLOCK_SLIDES = {"full_attention_layers": False}
MlpNames = Callable[[int], Names]  # a block's index -> its MLP's (our name, theirs)
TRAINING_ONLY = (("attention_dropout", 0.0),)  # every Llama-block class's


@dataclass(frozen=True)
class ClassDefaults:
    """What a transformers class takes for a key its config.json leaves out."""

    kv_heads: int | None = None
    """num_key_value_heads; None: num_attention_heads."""
    head_dim: int | None = None
    """head_dim; None: hidden_size / num_attention_heads."""
    max_positions: int = 2048
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0


ROPE_KEYS = ("rope_type", "type", "rope_theta")  # rope_parameters' keys beside the scaling's


def rope_fields(config: ConfigJson, default_theta: float) -> dict[str, Any]:
    """Our RoPE settings (rope_theta, rope_scaling) of config.json's rope_scaling or
    rope_parameters (transformers 5's name; rope_scaling wins when both are set) and
    rope_theta: plain RoPE, llama3 or yarn (a yarn without original_max_position_embeddings
    takes max_position_embeddings, as transformers does); another type or key is refused."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise config.refuse(f"{key} {rope!r} (per-layer RoPE) is not supported")
    theta = float(rope.get("rope_theta", config.get("rope_theta", default_theta)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if kind not in ROPE_SCALING_KEYS:
        supported = ", ".join(["default", *ROPE_SCALING_KEYS])
        raise config.refuse(f"{key}.rope_type {kind!r} is not supported; supported: {supported}")
    keys = ROPE_SCALING_KEYS[kind]
    for name in rope:
        if name not in keys and name not in ROPE_KEYS:
            raise config.refuse(
                f"{key}.{name} is not supported with rope_type {kind}; supported: "
                + ", ".join(keys)
            )
    scaling = {name: rope[name] for name in keys if rope.get(name) is not None}
    if kind == "yarn":
        scaling.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings")
        )
    return {"rope_theta": theta, "rope_scaling": RopeScalingConfig(type=kind, **scaling)}


def rope_json(cfg: Config) -> dict[str, Any]:
    """config.json's RoPE keys of our model: the inverse of rope_fields."""
    theta, scaling = cfg.model.rope_theta, cfg.model.rope_scaling
    if scaling is None:
        return {
            "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        }
    params = {k: v for k, v in scaling.to_dict().items() if k != "type" and v is not None}
    rope = {"rope_type": scaling.type, **params}
    # rope_parameters for transformers 5, rope_scaling (which it also reads) for transformers 4
    return {
        "rope_theta": theta,
        "rope_parameters": {**rope, "rope_theta": theta},
        "rope_scaling": rope,
    }


def window_fields(config: ConfigJson, key: str, window: Any, full: int = 0) -> dict[str, Any]:
    """Our attention-window settings (model.sliding_window, model.full_attention_layers) of a
    window `window` (config.json's `key`; None or false: full attention) in every block after
    the first `full`; a window that is no positive integer is refused."""
    if window is None or window is False:
        return {"sliding_window": None, "full_attention_layers": 0}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise config.refuse(
            f"{key} {window!r} is not supported; supported: a positive integer (the positions a "
            "query sees, itself included) or null"
        )
    return {"sliding_window": window, "full_attention_layers": full}


def block_fields(
    config: ConfigJson, arch: str, defaults: ClassDefaults, components: dict[str, bool]
) -> dict[str, Any]:
    """Our model.* settings of a Llama-block config.json, with the family's attention
    components and a dense MLP in every block (the MoE families replace `moe`)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise config.refuse(f"hidden_act {act!r} is not supported; supported: silu (SwiGLU)")
    n_head, d_model = config.need("num_attention_heads"), config.need("hidden_size")
    return dict(
        arch=arch,
        n_layer=config.need("num_hidden_layers"),
        n_head=n_head,
        n_kv_head=config.get("num_key_value_heads", defaults.kv_heads) or n_head,
        d_model=d_model,
        head_dim=config.get("head_dim", defaults.head_dim) or d_model // n_head,
        d_ff=config.need("intermediate_size"),
        vocab_size=config.need("vocab_size"),
        max_seq_len=config.get("max_position_embeddings", defaults.max_positions),
        norm_eps=config.get("rms_norm_eps", defaults.norm_eps),
        **rope_fields(config, defaults.rope_theta),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=components["qkv_bias"],
        qk_norm=components["qk_norm"],
        moe=MoEConfig(),
    )


def refuse_biases(config: ConfigJson, *keys: str) -> None:
    """A UserError for any of `keys` (attention_bias, mlp_bias) true: biases we do not have."""
    for key in keys:
        if config.get(key):
            raise config.refuse(
                f"{key} true is not supported (biases on every projection); supported: false "
                "(model.qkv_bias is q, k and v alone: Qwen2ForCausalLM)"
            )


def block_json(
    cfg: Config, derived: Derived, architecture: str, model_type: str, hybrid: bool = False
) -> dict:
    """The config.json keys every Llama-block family shares, for our model; a UserError for a
    partial RoPE (model.partial_rotary_factor < 1) or linear-attention blocks (model.layer_types)
    in a family without them (hybrid: Qwen3.5's has both)."""
    model = cfg.model
    if "linear_attention" in (model.layer_types or ()) and not hybrid:
        raise UserError(
            f"model.layer_types: linear_attention blocks: {architecture} (export --format hf) has "
            "full attention only; model.arch qwen3_5 can express them"
        )
    if model.partial_rotary_factor != 1 and not hybrid:
        raise UserError(
            f"model.partial_rotary_factor={model.partial_rotary_factor}: {architecture} (export "
            "--format hf) rotates whole heads; model.arch qwen3_5 can express it"
        )
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": derived.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": derived.d_ff,
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": derived.n_kv_head,
        "head_dim": derived.head_dim,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        **rope_json(cfg),
        "hidden_act": "silu",
        "attention_dropout": model.dropout,
    }


def tensors_to_hf(cfg: Config, derived: Derived, ours: Tensors, mlp: MlpNames) -> Tensors:
    """Their tensors of ours, block i's MLP named as mlp(i) says."""
    n_head, n_kv_head, head_dim = cfg.model.n_head, derived.n_kv_head, derived.head_dim
    out: Tensors = {"model.embed_tokens.weight": ours["tok_emb.weight"]}
    for i in range(cfg.model.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if cfg.model.qkv_bias else ("weight",):
            qkv = split_qkv(ours[f"{src}attn.qkv.{kind}"], n_head, n_kv_head, head_dim)
            for name, part in zip(QKV, qkv, strict=True):
                out[dst + name + kind] = part.contiguous()
        names = (*BLOCK, *(QK_NORM if cfg.model.qk_norm else ()), *mlp(i))
        copy_to_hf(ours, out, names, src, dst)
    out["model.norm.weight"] = ours["norm_f.weight"]
    return out


def tensors_from_hf(hf: Tensors, fields: dict[str, Any], mlp: MlpNames) -> Tensors:
    """Our tensors of theirs, block i's MLP named as mlp(i) says."""
    n_head, n_kv_head, head_dim = fields["n_head"], fields["n_kv_head"], fields["head_dim"]
    ours: Tensors = {"tok_emb.weight": hf.pop("model.embed_tokens.weight")}
    for i in range(fields["n_layer"]):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias") if fields["qkv_bias"] else ("weight",):
            q, key, value = (hf.pop(src + name + kind) for name in QKV)
            qkv = merge_qkv(q, key, value, n_head, n_kv_head, head_dim)
            ours[f"{dst}attn.qkv.{kind}"] = qkv
        names = (*BLOCK, *(QK_NORM if fields["qk_norm"] else ()), *mlp(i))
        take_from_hf(hf, ours, names, src, dst)
    ours["norm_f.weight"] = hf.pop("model.norm.weight")
    return ours


def dense(i: int) -> Names:
    """Every block's MLP names in a family without experts."""
    return DENSE_MLP


def model_fields(config: ConfigJson) -> dict[str, Any]:
    """Our model.* settings of a Llama config.json (Llama 2, 3 and 3.1-3.3 without rope
    scaling)."""
    refuse_biases(config, "attention_bias", "mlp_bias")
    return block_fields(config, "llama", ClassDefaults(), PLAIN)


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    return dict(
        block_json(cfg, derived, "LlamaForCausalLM", "llama"), attention_bias=False, mlp_bias=False
    )


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    return tensors_to_hf(cfg, derived, ours, dense)


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    return tensors_from_hf(hf, fields, dense)


FAMILY = Family(
    name="Llama 2/3.x",
    architectures=("LlamaForCausalLM",),
    model_type="llama",
    arch="llama",
    components={**PLAIN, "sliding_window": False, "experts": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=("rotary_emb.inv_freq",),
    training_only=TRAINING_ONLY,
)
