"""Llama (LlamaForCausalLM): RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases.

HF Llama has separate q_proj [n d, h], k_proj and v_proj [k d, h] where our qkv is grouped by
kv head. It numbers query head j as ours does (its kv head is j // (n / k)), and our RoPE pairs
dims i and i + d/2 as its rotate_half does, so no row permutation beyond the grouping is needed.
The tensor mapping takes the MLP's names as an argument: Mixtral is a Llama whose every MLP is a
mixture of experts (megatronish.hf.mixtral).
"""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived, MoEConfig
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
DENSE_MLP = tuple(
    (f"mlp.{part}.weight", f"mlp.{part}_proj.weight") for part in ("gate", "up", "down")
)
QKV = tuple(f"self_attn.{part}_proj.weight" for part in "qkv")


def model_fields(config: ConfigJson) -> dict[str, Any]:
    """Our model.* settings of a Llama config.json (a dense MLP in every block)."""
    if (
        config.get("hidden_act", "silu") != "silu"
        or config.get("attention_bias")
        or config.get("mlp_bias")
    ):
        raise config.refuse("only hidden_act silu without attention or MLP biases is supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise config.refuse(f"rope scaling {rope!r} is not supported; only plain RoPE")
    n_head, d_model = config.need("num_attention_heads"), config.need("hidden_size")
    head_dim = config.get("head_dim")
    decoupled = {} if head_dim in (None, d_model // n_head) else {"head_dim": head_dim}
    return dict(
        **decoupled,
        arch="llama",
        n_layer=config.need("num_hidden_layers"),
        n_head=n_head,
        n_kv_head=config.get("num_key_value_heads") or n_head,
        d_model=d_model,
        d_ff=config.need("intermediate_size"),
        vocab_size=config.need("vocab_size"),
        max_seq_len=config.need("max_position_embeddings", 2048),
        norm_eps=config.need("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe=MoEConfig(),
    )


def exports(cfg: Config, derived: Derived) -> bool:
    return cfg.model.arch == "llama" and not derived.moe_layers


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    model = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": derived.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": derived.d_ff,
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": derived.n_kv_head,
        "head_dim": derived.head_dim,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": model.dropout,
    }


def tensors_to_hf(cfg: Config, derived: Derived, ours: Tensors, mlp: Names) -> Tensors:
    """Their tensors of ours, every block's MLP named as `mlp` says."""
    n_head, n_kv_head, head_dim = cfg.model.n_head, derived.n_kv_head, derived.head_dim
    out: Tensors = {"model.embed_tokens.weight": ours["tok_emb.weight"]}
    for i in range(cfg.model.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        qkv = split_qkv(ours[src + "attn.qkv.weight"], n_head, n_kv_head, head_dim)
        for name, part in zip(QKV, qkv, strict=True):
            out[dst + name] = part.contiguous()
        copy_to_hf(ours, out, (*BLOCK, *mlp), src, dst)
    out["model.norm.weight"] = ours["norm_f.weight"]
    return out


def tensors_from_hf(hf: Tensors, fields: dict[str, Any], mlp: Names) -> Tensors:
    """Our tensors of theirs, every block's MLP named as `mlp` says."""
    n_head, n_kv_head = fields["n_head"], fields["n_kv_head"]
    ours: Tensors = {"tok_emb.weight": hf.pop("model.embed_tokens.weight")}
    for i in range(fields["n_layer"]):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        q, key, value = (hf.pop(src + name) for name in QKV)
        ours[dst + "attn.qkv.weight"] = merge_qkv(
            q, key, value, n_head, n_kv_head, q.shape[0] // n_head
        )
        take_from_hf(hf, ours, (*BLOCK, *mlp), src, dst)
    ours["norm_f.weight"] = hf.pop("model.norm.weight")
    return ours


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    return tensors_to_hf(cfg, derived, ours, DENSE_MLP)


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    return tensors_from_hf(hf, fields, DENSE_MLP)


FAMILY = Family(
    architectures=("LlamaForCausalLM",),
    model_type="llama",
    model_fields=model_fields,
    exports=exports,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=("rotary_emb.inv_freq",),
)
