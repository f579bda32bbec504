"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention, the first
first_k_dense_replace blocks dense (intermediate_size), every later one a mixture of
n_routed_experts experts of moe_intermediate_size beside n_shared_experts shared ones, routed by
sigmoid scores with a per-expert correction bias (topk_method noaux_tc, group-limited by n_group
and topk_group, the chosen scores renormalized and times routed_scaling_factor: our sigmoid
router; the bias is mlp.gate.e_score_correction_bias), and num_nextn_predict_layers
multi-token prediction modules (model.mtp_depth).

Attention: ours q_a, q_a_norm, q_b (or q), kv_a, kv_a_norm, kv_b, proj are its self_attn
q_a_proj, q_a_layernorm, q_b_proj (q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj with the same rows: kv_a [latent | rope], kv_b per head [nope | v], each query head
[nope | rope], the rotary dims interleaved in pairs as rope_interleave true says (the published
layout, the one we read; export writes it). Expert e is mlp.experts.<e>.gate_proj / up_proj /
down_proj as the Hub's checkpoints name them (transformers' fused gate_up_proj and down_proj
are read too), the shared experts mlp.shared_experts.

Multi-token prediction module k (0-based) is model.layers.<num_hidden_layers + k>, as the
published checkpoints store it: enorm, hnorm, eh_proj, the decoder layer's own weights (MoE
from first_k_dense_replace on, as any block), shared_head.norm (its final norm) and copies of
the shared embed_tokens and shared_head.head (the output layer), which export writes and import
checks equal to the model's. transformers builds no such layer and ignores its tensors; import
reads them when present and leaves the modules off when they are absent (a save_pretrained
directory).
"""

from __future__ import annotations

from typing import Any

import torch

from megatronish.config import Config, Derived, MoEConfig
from megatronish.config.model_schema import MLAConfig
from megatronish.config.presets import PRESETS
from megatronish.errors import UserError
from megatronish.hf import llama
from megatronish.hf.family import (
    HEAD,
    ConfigJson,
    Family,
    Names,
    Tensors,
    copy_to_hf,
    take_from_hf,
    unfuse_experts,
)
from megatronish.hf.mixtral import expert_names
from megatronish.hf.qwen3_moe import EXPERT

DEFAULTS = llama.ClassDefaults(max_positions=4096)
Q_LORA = (
    ("attn.q_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
    ("attn.q_b.weight", "self_attn.q_b_proj.weight"),
)
Q_PLAIN = (("attn.q.weight", "self_attn.q_proj.weight"),)
KV = (
    ("attn.kv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("attn.kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
    ("attn.kv_b.weight", "self_attn.kv_b_proj.weight"),
)
SHARED = tuple(
    (f"mlp.shared.{ours}.weight", f"mlp.shared_experts.{theirs}.weight") for ours, theirs in EXPERT
)
BIAS = (("mlp.router.bias", "mlp.gate.e_score_correction_bias"),)
MTP = (
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),
    ("norm.weight", "shared_head.norm.weight"),
)
# The copies of the shared weights a published multi-token prediction layer holds.
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
# model.moe settings no weight holds: the preset's (DeepSeek-V3's training).
TRAINING = ("bias_update_speed", "seq_aux_loss_coef", "aux_loss_coef", "z_loss_coef")


def _refuse_unless(config: ConfigJson, key: str, supported: Any, what: str) -> None:
    """A UserError when config.json sets `key` to anything but `supported`."""
    value = config.get(key, supported)
    if value != supported:
        raise config.refuse(f"{key} {value!r} is not supported; supported: {supported!r} ({what})")


def model_fields(config: ConfigJson) -> dict[str, Any]:
    for key, supported, what in (
        ("topk_method", "noaux_tc", "top-k of the bias-corrected sigmoid scores"),
        ("scoring_func", "sigmoid", "model.moe.router sigmoid"),
        ("norm_topk_prob", True, "the chosen scores renormalized"),
        ("attention_bias", False, "no biases on the projections"),
        ("moe_layer_freq", 1, "experts in every block from first_k_dense_replace on"),
        ("rope_interleave", True, "the published weights' interleaved rotary pairs"),
    ):
        _refuse_unless(config, key, supported, what)
    fields = llama.block_fields(config, "deepseek_v3", DEFAULTS, llama.PLAIN)
    preset = PRESETS["deepseek_v3"]["moe"]
    moe = MoEConfig(
        num_experts=config.get("n_routed_experts", 256),
        top_k=config.get("num_experts_per_tok", 8),
        d_ff=config.get("moe_intermediate_size", 2048),
        router="sigmoid",
        n_group=config.get("n_group", 8) or 1,
        topk_group=config.get("topk_group", 4) or 1,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5)),
        n_shared_experts=config.get("n_shared_experts", 1) or 0,
        first_k_dense=config.get("first_k_dense_replace", 3),
        **{key: preset[key] for key in TRAINING},
    )
    mla = MLAConfig(
        q_lora_rank=config.get("q_lora_rank", 1536),
        kv_lora_rank=config.get("kv_lora_rank", 512),
        qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=config.get("qk_rope_head_dim", 64),
        v_head_dim=config.get("v_head_dim", 128),
    )
    mtp = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1))
    return dict(
        fields,
        n_kv_head=None,  # every head its own keys and values from the latent
        head_dim=None,
        attention="mla",
        mla=mla,
        moe=moe,
        mtp_depth=mtp or 0,
        **llama.window_fields(config, "sliding_window", None),
    )


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    """DeepSeek-V3's keys; a UserError for a model its class cannot express."""
    model, moe, mla = cfg.model, cfg.model.moe, cfg.model.mla
    for bad, key, valid in (
        (model.attention != "mla", "model.attention", "mla"),
        (moe.router != "sigmoid", "model.moe.router", "sigmoid"),
        (moe.every != 1, "model.moe.every", "1 (experts in every block after first_k_dense)"),
    ):
        if bad:
            value = getattr(moe if key.startswith("model.moe") else model, key.rpartition(".")[2])
            raise UserError(
                f"{key}: DeepseekV3ForCausalLM (export --format hf) has no equivalent of "
                f"{value!r}; valid for export: {valid}"
            )
    out = llama.block_json(cfg, derived, "DeepseekV3ForCausalLM", "deepseek_v3")
    for key in ("head_dim", "num_key_value_heads"):
        out.pop(key)
    return dict(
        out,
        num_key_value_heads=model.n_head,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rope_interleave=True,
        attention_bias=False,
        moe_intermediate_size=derived.moe_d_ff,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        n_shared_experts=derived.shared_d_ff // derived.moe_d_ff,
        first_k_dense_replace=moe.first_k_dense,
        moe_layer_freq=1,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=model.mtp_depth,
    )


def block_names(fields: dict[str, Any], index: int) -> Names:
    """Block `index`'s (our name, theirs), a multi-token prediction block's too: the
    attention's, then the dense MLP's or the router's, its bias, the experts' and the shared
    experts'."""
    moe = fields["moe"]
    names = [*llama.BLOCK, *(Q_PLAIN if fields["mla"].q_lora_rank is None else Q_LORA), *KV]
    if index < moe.first_k_dense:
        return names + list(llama.DENSE_MLP)
    names += expert_names("mlp.gate", "mlp.experts.", EXPERT, moe.num_experts) + list(BIAS)
    return names + (list(SHARED) if moe.n_shared_experts else [])


def _fields_of(cfg: Config, derived: Derived) -> dict[str, Any]:
    """What block_names reads, of our model."""
    moe = cfg.model.moe
    shared = derived.shared_d_ff // derived.moe_d_ff
    return {
        "moe": MoEConfig(
            num_experts=moe.num_experts, first_k_dense=moe.first_k_dense, n_shared_experts=shared
        ),
        "mla": cfg.model.mla,
    }


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    fields, n_layer = _fields_of(cfg, derived), cfg.model.n_layer
    out: Tensors = {"model.embed_tokens.weight": ours["tok_emb.weight"]}
    for i in range(n_layer):
        copy_to_hf(ours, out, block_names(fields, i), f"blocks.{i}.", f"model.layers.{i}.")
    out["model.norm.weight"] = ours["norm_f.weight"]
    head = ours["tok_emb.weight" if derived.tie_embeddings else HEAD]
    for k in range(cfg.model.mtp_depth):
        src, dst = f"mtp.layers.{k}.", f"model.layers.{n_layer + k}."
        copy_to_hf(ours, out, block_names(fields, n_layer + k), src + "block.", dst)
        copy_to_hf(ours, out, MTP, src, dst)
        for name, shared in zip(MTP_SHARED, (ours["tok_emb.weight"], head), strict=True):
            out[dst + name] = shared.clone()  # a copy: safetensors stores no shared memory
    return out


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    """Their tensors -> ours; sets fields["mtp_depth"] to 0 when the multi-token prediction
    layers' weights are absent."""
    n_layer = fields["n_layer"]
    if f"model.layers.{n_layer}.eh_proj.weight" not in hf:
        fields["mtp_depth"] = 0
    ours: Tensors = {"tok_emb.weight": hf.pop("model.embed_tokens.weight")}
    blocks = [(f"blocks.{i}.", i) for i in range(n_layer)]
    blocks += [(f"mtp.layers.{k}.block.", n_layer + k) for k in range(fields["mtp_depth"])]
    for dst, index in blocks:
        src = f"model.layers.{index}."
        unfuse_experts(hf, src + "mlp.experts.", tuple(t for _, t in EXPERT), src + "mlp.experts.")
        take_from_hf(hf, ours, block_names(fields, index), src, dst)
    ours["norm_f.weight"] = hf.pop("model.norm.weight")
    head = ours["tok_emb.weight"] if fields["tie_embeddings"] else hf[HEAD]
    for k in range(fields["mtp_depth"]):
        src = f"model.layers.{n_layer + k}."
        take_from_hf(hf, ours, MTP, src, f"mtp.layers.{k}.")
        for name, shared in zip(MTP_SHARED, (ours["tok_emb.weight"], head), strict=True):
            copy = hf.pop(src + name, None)
            if copy is not None and not torch.equal(copy, shared):
                raise UserError(
                    f"tensor {src + name} differs from the model's own; megatronish's "
                    "multi-token prediction shares the embedding and the output layer"
                )
    return ours


FAMILY = Family(
    name="DeepSeek-V3",
    architectures=("DeepseekV3ForCausalLM",),
    model_type="deepseek_v3",
    arch="deepseek_v3",
    components={**llama.PLAIN, "sliding_window": False, "experts": True},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
