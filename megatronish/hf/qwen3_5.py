"""Qwen3.5 (Qwen3_5ForCausalLM, the text model: Qwen3_5TextConfig, model_type qwen3_5_text).

Its full-attention blocks are Qwen3's with three differences, all components of the qwen3_5
preset: q_proj gives each head's query and then its output gate ([n, 2, d] rows, interleaved
per head), attention's output is multiplied by sigmoid(gate) before o_proj; RoPE rotates each
head's first head_dim x partial_rotary_factor dims (rope_parameters' partial_rotary_factor,
0.25 by default); and every RMSNorm scales by 1 + weight (our norm_offset 1: the tensors are
copied as they are). Its text positions are the same in the three mrope sections, so mrope is
plain RoPE for a text model.

The blocks config.json's layer_types marks linear_attention are Gated DeltaNet layers
(model.layer_types): their tensors map as a table (LINEAR_ATTENTION, named as transformers names
them), except in_proj_qkv's rows and conv1d's channels, which ours group by key head
(megatronish.model.gated_deltanet.qkv_rows).

Shapes: h d_model, n query heads, k kv heads, d head dim, g = n / k. Ours: qkv [(2n + 2k) d, h]
by kv group (each: its g query heads, their g gates, its key head, its value head).
"""

from __future__ import annotations

from typing import Any

import torch

from megatronish.config import Config, Derived
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family, Names, Tensors, copy_to_hf, take_from_hf
from megatronish.model.gated_deltanet import qkv_rows

DEFAULTS = llama.ClassDefaults(kv_heads=4, head_dim=256, max_positions=32768)
COMPONENTS = {"qkv_bias": False, "qk_norm": True}
PARTIAL_ROTARY = 0.25  # Qwen3_5TextConfig's default
FULL, LINEAR = "full_attention", "linear_attention"
FULL_INTERVAL = 4  # without layer_types: every 4th block full attention, as transformers fills

NORMS: Names = (
    ("norm1.weight", "input_layernorm.weight"),
    ("norm2.weight", "post_attention_layernorm.weight"),
)
FULL_ATTENTION: Names = (("attn.proj.weight", "self_attn.o_proj.weight"), *llama.QK_NORM)
LINEAR_ATTENTION: Names = tuple(
    (f"attn.{name}", f"linear_attn.{name}")
    for name in (
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "dt_bias",
        "A_log",
        "norm.weight",
        "out_proj.weight",
    )
)
LINEAR_KEYS = (  # config.json's keys of the linear-attention layers, ours of the same name
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


LINEAR_QKV, LINEAR_CONV = "linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"


def linear_rows(sizes: Any) -> torch.Tensor:
    """Our order of transformers' in_proj_qkv rows and conv1d channels (ours = theirs[rows]);
    sizes: anything with the model.linear_* sizes as attributes or keys."""
    get = sizes.get if isinstance(sizes, dict) else lambda key: getattr(sizes, key)
    return qkv_rows(
        get("linear_num_key_heads"),
        get("linear_num_value_heads"),
        get("linear_key_head_dim"),
        get("linear_value_head_dim"),
    )


def layer_types_of(config: ConfigJson, n_layer: int) -> list[str]:
    """config.json's layer_types (or transformers' pattern without it); a UserError for a kind
    neither full nor linear attention, or linear attention while our model has none."""
    types = config.get("layer_types")
    if types is None:
        types = [FULL if (i + 1) % FULL_INTERVAL == 0 else LINEAR for i in range(n_layer)]
    kinds = (FULL, LINEAR)
    if not isinstance(types, list) or len(types) != n_layer or set(types) - set(kinds):
        raise config.refuse(
            f"layer_types {types!r} is not supported; supported: {n_layer} entries of "
            + " or ".join(kinds)
        )
    return types


def model_fields(config: ConfigJson, defaults: llama.ClassDefaults = DEFAULTS) -> dict[str, Any]:
    """Our model.* settings of a Qwen3_5TextConfig config.json (the blocks Qwen3.5-MoE shares,
    its class's defaults `defaults`)."""
    llama.refuse_biases(config, "attention_bias")
    fields = llama.block_fields(config, "qwen3_5", defaults, COMPONENTS)
    rope = config.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    fields["partial_rotary_factor"] = float(PARTIAL_ROTARY if partial is None else partial)
    types = layer_types_of(config, fields["n_layer"])
    if LINEAR in types:
        fields["layer_types"] = types
        fields.update({key: config.need(key) for key in LINEAR_KEYS})
    return fields


def layer_types(model: Any) -> list[str]:
    """Our model's layer kinds: model.layer_types where the model has linear layers, else full
    attention in every block."""
    return list(getattr(model, "layer_types", None) or [FULL] * model.n_layer)


def config_json(
    cfg: Config,
    derived: Derived,
    architecture: str = "Qwen3_5ForCausalLM",
    model_type: str = "qwen3_5_text",
) -> dict[str, Any]:
    """config.json's keys of our model as `architecture` (Qwen3.5-MoE's too)."""
    model = cfg.model
    out = dict(
        llama.block_json(cfg, derived, architecture, model_type, hybrid=True),
        attention_bias=False,
        layer_types=layer_types(model),
    )
    out["rope_parameters"]["partial_rotary_factor"] = model.partial_rotary_factor
    if LINEAR in out["layer_types"]:
        out.update({key: getattr(model, key) for key in LINEAR_KEYS})
    return out


def gated_q_to_ours(q_proj: torch.Tensor, n_head: int, head_dim: int):
    """Their q_proj [n * 2d, h] (each head's query rows, then its gate's) -> (q, gate), each
    [n d, h]."""
    heads = q_proj.reshape(n_head, 2, head_dim, *q_proj.shape[1:])
    return heads[:, 0].reshape(n_head * head_dim, -1), heads[:, 1].reshape(n_head * head_dim, -1)


def qkv_to_ours(q_proj, k_proj, v_proj, n_head: int, n_kv_head: int, head_dim: int):
    """Their q_proj [2 n d, h], k_proj and v_proj [k d, h] -> our qkv [(2n + 2k) d, h]."""
    q, gate = gated_q_to_ours(q_proj, n_head, head_dim)
    group, width = n_head // n_kv_head, q_proj.shape[1]
    parts = [
        q.reshape(n_kv_head, group * head_dim, width),
        gate.reshape(n_kv_head, group * head_dim, width),
        k_proj.reshape(n_kv_head, head_dim, width),
        v_proj.reshape(n_kv_head, head_dim, width),
    ]
    return torch.cat(parts, dim=1).reshape(-1, width).contiguous()


def qkv_to_hf(qkv: torch.Tensor, n_head: int, n_kv_head: int, head_dim: int):
    """The inverse of qkv_to_ours: (q_proj, k_proj, v_proj)."""
    group, width = n_head // n_kv_head, qkv.shape[1]
    grouped = qkv.reshape(n_kv_head, 2 * group + 2, head_dim, width)
    q = grouped[:, :group].reshape(n_head, head_dim, width)
    gate = grouped[:, group : 2 * group].reshape(n_head, head_dim, width)
    q_proj = torch.stack([q, gate], dim=1).reshape(2 * n_head * head_dim, width)
    key, value = grouped[:, 2 * group], grouped[:, 2 * group + 1]
    return q_proj, key.reshape(-1, width).contiguous(), value.reshape(-1, width).contiguous()


QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def tensors_to_hf(cfg: Config, derived: Derived, ours: Tensors, mlp: llama.MlpNames) -> Tensors:
    """Their tensors of ours, block i's MLP named as mlp(i) says (Qwen3.5-MoE's experts)."""
    heads = (cfg.model.n_head, derived.n_kv_head, derived.head_dim)
    out: Tensors = {"model.embed_tokens.weight": ours["tok_emb.weight"]}
    for i, kind in enumerate(layer_types(cfg.model)):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        if kind == FULL:
            for name, part in zip(QKV, qkv_to_hf(ours[f"{src}attn.qkv.weight"], *heads)):
                out[dst + name] = part
        else:
            theirs = torch.argsort(linear_rows(cfg.model))
            out[dst + LINEAR_QKV] = ours[f"{src}attn.in_proj_qkv.weight"][theirs]
            out[dst + LINEAR_CONV] = ours[f"{src}attn.conv_weight"][theirs].unsqueeze(1)
        names = FULL_ATTENTION if kind == FULL else LINEAR_ATTENTION
        copy_to_hf(ours, out, (*names, *NORMS, *mlp(i)), src, dst)
    out["model.norm.weight"] = ours["norm_f.weight"]
    return out


def tensors_from_hf(hf: Tensors, fields: dict[str, Any], mlp: llama.MlpNames) -> Tensors:
    """Our tensors of theirs, block i's MLP named as mlp(i) says."""
    heads = (fields["n_head"], fields["n_kv_head"], fields["head_dim"])
    types = fields.get("layer_types") or [FULL] * fields["n_layer"]
    ours: Tensors = {"tok_emb.weight": hf.pop("model.embed_tokens.weight")}
    for i, kind in enumerate(types):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        if kind == FULL:
            q_proj, k_proj, v_proj = (hf.pop(src + name) for name in QKV)
            ours[f"{dst}attn.qkv.weight"] = qkv_to_ours(q_proj, k_proj, v_proj, *heads)
        else:
            rows = linear_rows(fields)
            ours[f"{dst}attn.in_proj_qkv.weight"] = hf.pop(src + LINEAR_QKV)[rows]
            ours[f"{dst}attn.conv_weight"] = hf.pop(src + LINEAR_CONV)[rows].squeeze(1)
        names = FULL_ATTENTION if kind == FULL else LINEAR_ATTENTION
        take_from_hf(hf, ours, (*names, *NORMS, *mlp(i)), src, dst)
    ours["norm_f.weight"] = hf.pop("model.norm.weight")
    return ours


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    return tensors_to_hf(cfg, derived, ours, llama.dense)


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    return tensors_from_hf(hf, fields, llama.dense)


FAMILY = Family(
    name="Qwen3.5",
    architectures=("Qwen3_5ForCausalLM",),
    model_type="qwen3_5_text",
    arch="qwen3_5",
    components={
        **COMPONENTS,
        "experts": False,
        "sliding_window": False,
        "full_attention_layers": False,
    },
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
