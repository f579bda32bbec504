"""GPT-OSS (GptOssForCausalLM): Llama blocks with biases on q, k, v and o, a sink logit per
query head (self_attn.sinks), sliding and full blocks as config.json's layer_types says, and in
every block a mixture of experts: its router (mlp.router: weight and a bias on the logits) and
its experts fused as transformers holds them, mlp.experts.gate_up_proj [E, h, 2 f] (each
expert's gate and up columns interleaved: gate 0, up 0, gate 1, ...), gate_up_proj_bias
[E, 2 f], down_proj [E, f, h] and down_proj_bias [E, h]; ours are each expert's gate, up and
down (weight [out, in] and bias).

The published checkpoints store gate_up_proj and down_proj in MXFP4 (`mxfp4`): each as
<name>_blocks (uint8 [E, rows, G, 16], two 4-bit E2M1 codes a byte, low nibble first: G groups
of 32 values along each row) and <name>_scales (uint8 [E, rows, G], a group's power of two +
127), rows the transposed tensor's ([E, 2 f, h / 32, 16] for gate_up_proj). Import dequantizes
them as transformers' convert_moe_packed_tensors does (the same table, ldexp, transpose), so
the weights are bit for bit transformers'. Export writes gate_up_proj and down_proj in bf16
(not MXFP4: a config.json without quantization_config) and every other tensor in fp32, and says
so.
"""

from __future__ import annotations

from typing import Any

import torch

from megatronish.config import Config, Derived, MoEConfig, attention_window
from megatronish.errors import UserError
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family, Tensors, merge_qkv, split_qkv
from megatronish.ops.reference import SWIGLU_ALPHA

DEFAULTS = llama.ClassDefaults(
    kv_heads=8, head_dim=64, max_positions=131072, norm_eps=1e-5, rope_theta=150000.0
)
# GptOssConfig's rope_parameters where config.json has none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
NORMS = (
    ("norm1.weight", "input_layernorm.weight"),
    ("norm2.weight", "post_attention_layernorm.weight"),
)
ATTENTION = (
    ("attn.proj.weight", "self_attn.o_proj.weight"),
    ("attn.proj.bias", "self_attn.o_proj.bias"),
    ("attn.sinks", "self_attn.sinks"),
    ("mlp.router.weight", "mlp.router.weight"),
    ("mlp.router.logit_bias", "mlp.router.bias"),
)
FUSED = "mlp.experts."
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""The E2M1 value of each 4-bit code (the sign its high bit)."""
EXPORTED_EXPERTS = torch.bfloat16
"""The dtype export writes gate_up_proj and down_proj in (the published checkpoints: MXFP4)."""
COMPONENTS = {"qkv_bias": False, "qk_norm": False, "experts": True, "dense_blocks": False}


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, name: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 blocks [E, rows, G, B] and scales [E, rows, G] -> [E, G * 2 B, rows] in dtype: each
    byte's low nibble then its high one, through FP4_VALUES, times 2 ** (scale - 127), rows
    then transposed (transformers' convert_moe_packed_tensors); a UserError naming `name` when
    the shapes disagree."""
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
        raise UserError(
            f"tensor {name}_blocks of shape {list(blocks.shape)} does not fit {name}_scales of "
            f"shape {list(scales.shape)}: MXFP4 needs blocks [experts, rows, groups, bytes] and "
            "scales [experts, rows, groups]"
        )
    codes = blocks.to(torch.uint8)
    exponents = scales.to(torch.int32) - 127
    table = torch.tensor(FP4_VALUES, dtype=dtype)
    *prefix, groups, width = codes.shape
    codes, exponents = codes.reshape(-1, width), exponents.reshape(-1, 1)
    out = torch.empty(codes.shape[0], 2 * width, dtype=dtype)
    out[:, 0::2] = table[(codes & 0x0F).to(torch.int)]
    out[:, 1::2] = table[(codes >> 4).to(torch.int)]
    torch.ldexp(out, exponents, out=out)
    return out.reshape(*prefix, groups * 2 * width).transpose(1, 2).contiguous()


def layer_types_of(config: ConfigJson, n_layer: int) -> list[str]:
    """config.json's layer_types, or GptOssConfig's (sliding, full, sliding, ...); a UserError
    for another kind or length."""
    types = config.get("layer_types")
    if types is None:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != n_layer or any(t not in kinds for t in types):
        raise config.refuse(
            f"layer_types {types!r} is not supported; supported: {n_layer} entries of "
            "sliding_attention or full_attention"
        )
    return types


def _refuse_unless(config: ConfigJson, key: str, default: Any, valid: Any, what: str) -> None:
    value = config.get(key, default)
    if value != valid:
        raise config.refuse(f"{key} {value!r} is not supported; supported: {valid!r} ({what})")


def model_fields(config: ConfigJson) -> dict[str, Any]:
    """Our model.* settings of a GptOssForCausalLM config.json (as GptOssConfig fills the keys
    it leaves out); a UserError naming a key we cannot run."""
    if not config.get("rope_scaling") and not config.get("rope_parameters"):
        config = ConfigJson({**config.raw, "rope_parameters": DEFAULT_ROPE}, config.path)
    _refuse_unless(config, "attention_bias", True, True, "biases on q, k, v and o")
    _refuse_unless(config, "swiglu_alpha", SWIGLU_ALPHA, SWIGLU_ALPHA, "the clamped SwiGLU's")
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method", "mxfp4") if isinstance(quantization, dict) else None
    if method != "mxfp4":
        raise config.refuse(
            f"quantization_config {quantization!r} is not supported; supported: none, or "
            "quant_method mxfp4 (the published experts)"
        )
    fields = llama.block_fields(config, "gpt_oss", DEFAULTS, COMPONENTS)
    types = layer_types_of(config, fields["n_layer"])
    window = config.get("sliding_window", 128) if "sliding_attention" in types else None
    fields.update(llama.window_fields(config, "sliding_window", window))
    output_losses = bool(config.get("output_router_logits", False))
    moe = MoEConfig(
        num_experts=config.get("num_local_experts", 128),
        top_k=config.get("num_experts_per_tok", 4),
        d_ff=fields["d_ff"],
        # transformers adds the balancing loss only where the router logits are output
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)) if output_losses else 0.0,
        z_loss_coef=0.0,
        router="topk_softmax",
    )
    limit = float(config.get("swiglu_limit", 7.0))
    return dict(fields, layer_types=types, swiglu_limit=limit, moe=moe)


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    """Llama's keys with GPT-OSS's; a UserError for experts GptOssForCausalLM cannot express."""
    model, moe = cfg.model, cfg.model.moe
    for bad, key, valid in (
        (moe.every != 1, "model.moe.every", "1 (experts in every block)"),
        (moe.first_k_dense > 0, "model.moe.first_k_dense", "0"),
        (moe.shared_expert, "model.moe.shared_expert", "false"),
        (moe.n_shared_experts > 0, "model.moe.n_shared_experts", "0"),
        (moe.router != "topk_softmax", "model.moe.router", "topk_softmax"),
    ):
        if bad:
            raise UserError(
                f"{key}: GptOssForCausalLM (export --format hf) has no equivalent of "
                f"{getattr(moe, key.rpartition('.')[2])!r}; valid for export: {valid}"
            )
    types = [
        "full_attention" if attention_window(model, i) is None else "sliding_attention"
        for i in range(model.n_layer)
    ]
    return dict(
        llama.block_json(cfg, derived, "GptOssForCausalLM", "gpt_oss"),
        intermediate_size=derived.moe_d_ff,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=False,
        sliding_window=model.sliding_window,
        layer_types=types,
        swiglu_limit=model.swiglu_limit,
        attention_bias=True,
    )


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    n_head, n_kv_head, head_dim = cfg.model.n_head, derived.n_kv_head, derived.head_dim
    out: Tensors = {"model.embed_tokens.weight": ours["tok_emb.weight"]}
    for i in range(cfg.model.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = split_qkv(ours[f"{src}attn.qkv.{kind}"], n_head, n_kv_head, head_dim)
            for name, part in zip(llama.QKV, qkv, strict=True):
                out[dst + name + kind] = part.contiguous()
        for mine, theirs in (*NORMS, *ATTENTION):
            out[dst + theirs] = ours[src + mine]
        out.update(_fused_experts(ours, src, dst + FUSED, cfg.model.moe.num_experts))
    out["model.norm.weight"] = ours["norm_f.weight"]
    return out


def _fused_experts(ours: Tensors, src: str, dst: str, num_experts: int) -> Tensors:
    """One block's experts in transformers' fused layout (gate and up interleaved), the two
    tensors the published checkpoints store in MXFP4 in EXPORTED_EXPERTS."""

    def stacked(name: str) -> torch.Tensor:
        return torch.stack([ours[f"{src}mlp.experts.{e}.{name}"] for e in range(num_experts)])

    gate, up = stacked("gate.weight"), stacked("up.weight")  # [E, f, h]
    gate_bias, up_bias = stacked("gate.bias"), stacked("up.bias")  # [E, f]
    gate_up = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
    return {
        dst + "gate_up_proj": gate_up.to(EXPORTED_EXPERTS),
        dst + "gate_up_proj_bias": torch.stack([gate_bias, up_bias], dim=2).flatten(1, 2),
        dst + "down_proj": stacked("down.weight").transpose(1, 2).to(EXPORTED_EXPERTS),
        dst + "down_proj_bias": stacked("down.bias"),
    }


def _expert_weight(hf: Tensors, name: str) -> torch.Tensor:
    """The fused tensor `name` (its MXFP4 blocks and scales dequantized where it has them)."""
    if name + "_blocks" in hf or name + "_scales" in hf:
        return dequantize_mxfp4(hf.pop(name + "_blocks"), hf.pop(name + "_scales"), name)
    return hf.pop(name)


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    n_head, n_kv_head, head_dim = fields["n_head"], fields["n_kv_head"], fields["head_dim"]
    ours: Tensors = {"tok_emb.weight": hf.pop("model.embed_tokens.weight")}
    for i in range(fields["n_layer"]):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            q, key, value = (hf.pop(src + name + kind) for name in llama.QKV)
            ours[f"{dst}attn.qkv.{kind}"] = merge_qkv(q, key, value, n_head, n_kv_head, head_dim)
        for mine, theirs in (*NORMS, *ATTENTION):
            ours[dst + mine] = hf.pop(src + theirs)
        experts = src + FUSED
        gate_up = _expert_weight(hf, experts + "gate_up_proj").transpose(1, 2)  # [E, 2 f, h]
        gate_up_bias = hf.pop(experts + "gate_up_proj_bias")  # [E, 2 f]
        down = _expert_weight(hf, experts + "down_proj").transpose(1, 2)  # [E, h, f]
        down_bias = hf.pop(experts + "down_proj_bias")
        for e in range(gate_up.shape[0]):
            mine = f"{dst}mlp.experts.{e}."
            ours[mine + "gate.weight"] = gate_up[e, 0::2].contiguous()
            ours[mine + "up.weight"] = gate_up[e, 1::2].contiguous()
            ours[mine + "gate.bias"] = gate_up_bias[e, 0::2].contiguous()
            ours[mine + "up.bias"] = gate_up_bias[e, 1::2].contiguous()
            ours[mine + "down.weight"] = down[e].contiguous()
            ours[mine + "down.bias"] = down_bias[e]
    ours["norm_f.weight"] = hf.pop("model.norm.weight")
    return ours


FAMILY = Family(
    name="GPT-OSS",
    architectures=("GptOssForCausalLM",),
    model_type="gpt_oss",
    arch="gpt_oss",
    components=COMPONENTS,
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
    export_note="note: experts written in bf16 (the published checkpoint stores them in MXFP4)",
)
