"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, GELU (tanh), biases, tied embeddings.

HF GPT-2 uses Conv1D, weights [in, out] (ours [out, in]), and a fused c_attn [h, q (n d) | k
(n d) | v (n d)] where ours is grouped by head (n = k: each head's q, k, v rows together). It
numbers query heads as ours does, so no row permutation beyond the grouping is needed.
"""

from __future__ import annotations

from typing import Any

import torch

from megatronish.config import Config, Derived, MoEConfig
from megatronish.hf.family import (
    ConfigJson,
    Family,
    Tensors,
    copy_to_hf,
    merge_qkv,
    split_qkv,
    take_from_hf,
    transposed,
)

NORMS = tuple(
    (f"{ours}.{kind}", f"{theirs}.{kind}")
    for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2"))
    for kind in ("weight", "bias")
)
# Our linear -> its Conv1D: the weight transposed, the bias as it is.
CONV1D = (("attn.proj", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj"))
CONV1D_BIASES = tuple((f"{ours}.bias", f"{theirs}.bias") for ours, theirs in CONV1D)
FINAL_NORM = (("norm_f.weight", "ln_f.weight"), ("norm_f.bias", "ln_f.bias"))


def model_fields(config: ConfigJson) -> dict[str, Any]:
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise config.refuse(
            f"activation_function {act!r} is not supported; supported: gelu_new, gelu_pytorch_tanh"
        )
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(key):
            raise config.refuse(f"{key} true is not supported; supported: false")
    if not config.get("scale_attn_weights", True):
        raise config.refuse(
            "scale_attn_weights false (unscaled attention) is not supported; supported: true"
        )
    return dict(
        arch="gpt2",
        n_layer=config.need("n_layer"),
        n_head=config.need("n_head"),
        n_kv_head=None,
        d_model=config.need("n_embd"),
        d_ff=config.get("n_inner"),
        vocab_size=config.need("vocab_size"),
        max_seq_len=config.need("n_positions", 1024),
        norm_eps=config.need("layer_norm_epsilon", 1e-5),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        head_dim=None,
        qkv_bias=False,
        qk_norm=False,
        moe=MoEConfig(),
    )


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    model = cfg.model
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": derived.vocab_size,
        "n_positions": model.max_seq_len,
        "n_ctx": model.max_seq_len,
        "n_embd": model.d_model,
        "n_layer": model.n_layer,
        "n_head": model.n_head,
        "n_inner": derived.d_ff,
        "activation_function": "gelu_new",
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "layer_norm_epsilon": model.norm_eps,
        "scale_attn_weights": True,
    }


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    n_head, head_dim = cfg.model.n_head, derived.head_dim
    out: Tensors = {
        "transformer.wte.weight": ours["tok_emb.weight"],
        "transformer.wpe.weight": ours["pos_emb.weight"],
    }
    for i in range(cfg.model.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        copy_to_hf(ours, out, NORMS + CONV1D_BIASES, src, dst)
        qkv_weight = split_qkv(ours[src + "attn.qkv.weight"], n_head, n_head, head_dim)
        out[dst + "attn.c_attn.weight"] = transposed(torch.cat(qkv_weight))
        out[dst + "attn.c_attn.bias"] = torch.cat(
            split_qkv(ours[src + "attn.qkv.bias"], n_head, n_head, head_dim)
        )
        for mine, theirs in CONV1D:
            out[dst + theirs + ".weight"] = transposed(ours[src + mine + ".weight"])
    copy_to_hf(ours, out, FINAL_NORM, "", "transformer.")
    return out


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    """Our tensors of a GPT2LMHeadModel state dict (or a GPT2Model one: no 'transformer.')."""
    for name in [name for name in hf if name.startswith("transformer.")]:
        hf[name.removeprefix("transformer.")] = hf.pop(name)
    n_head = fields["n_head"]
    ours: Tensors = {"tok_emb.weight": hf.pop("wte.weight"), "pos_emb.weight": hf.pop("wpe.weight")}
    head_dim = ours["tok_emb.weight"].shape[1] // n_head
    for i in range(fields["n_layer"]):
        src, dst = f"h.{i}.", f"blocks.{i}."
        take_from_hf(hf, ours, NORMS + CONV1D_BIASES, src, dst)
        q, key, value = hf.pop(src + "attn.c_attn.weight").t().chunk(3)
        ours[dst + "attn.qkv.weight"] = merge_qkv(q, key, value, n_head, n_head, head_dim)
        q_bias, k_bias, v_bias = hf.pop(src + "attn.c_attn.bias").chunk(3)
        ours[dst + "attn.qkv.bias"] = merge_qkv(q_bias, k_bias, v_bias, n_head, n_head, head_dim)
        for mine, theirs in CONV1D:
            ours[dst + mine + ".weight"] = transposed(hf.pop(src + theirs + ".weight"))
    take_from_hf(hf, ours, FINAL_NORM, "", "")
    return ours


FAMILY = Family(
    name="GPT-2",
    architectures=("GPT2LMHeadModel",),
    model_type="gpt2",
    arch="gpt2",
    components={"qkv_bias": False, "qk_norm": False, "sliding_window": False, "experts": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=(".attn.bias", ".attn.masked_bias"),
    embeddings=("transformer.wte.weight", "wte.weight"),
    training_only=tuple((key, 0.1) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
)
