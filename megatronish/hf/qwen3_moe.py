"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, and mixtures of experts of
moe_intermediate_size in the blocks decoder_sparse_step and mlp_only_layers select (dense MLPs
of intermediate_size elsewhere), which must be blocks 0, every, 2 every, ... (model.moe.every).
Its router is ours (softmax_topk: softmax, top-k, renormalized) when norm_topk_prob is true;
false is refused. Expert e of a block is its mlp.experts.<e>.gate_proj / up_proj / down_proj,
as the Hub's checkpoints name them (transformers' fused mlp.experts.gate_up_proj and down_proj
are read too); the router is its mlp.gate."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived, MoEConfig, moe_layers
from megatronish.errors import UserError
from megatronish.hf import llama, qwen3
from megatronish.hf.family import ConfigJson, Family, Names, Tensors, unfuse_experts
from megatronish.hf.mixtral import expert_names, num_experts_of

DEFAULTS = llama.ClassDefaults(kv_heads=4, max_positions=32768)
EXPERT = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


def moe_every(config: ConfigJson, n_layer: int) -> int:
    """model.moe.every of the blocks with experts: those not in mlp_only_layers whose index
    + 1 is a multiple of decoder_sparse_step; a UserError when they are not 0, every, ..."""
    step = config.get("decoder_sparse_step", 1)
    dense = config.get("mlp_only_layers") or []
    sparse = [i for i in range(n_layer) if i not in dense and (i + 1) % step == 0]
    every = sparse[1] if len(sparse) > 1 else n_layer
    if not sparse or sparse != list(range(0, n_layer, every)):
        raise config.refuse(
            f"decoder_sparse_step {step} with mlp_only_layers {dense} puts experts in blocks "
            f"{sparse}; supported: blocks 0, k, 2k, ... for some k >= 1 (model.moe.every), "
            "e.g. decoder_sparse_step 1 and mlp_only_layers []"
        )
    return every


def window_fields(config: ConfigJson) -> dict[str, Any]:
    """Qwen3-MoE's window: sliding_window in every block under use_sliding_window (its class
    has no max_window_layers or layer_types)."""
    on = config.get("use_sliding_window", False)
    return llama.window_fields(
        config, "sliding_window", config.get("sliding_window", 4096) if on else None
    )


def window_json(cfg: Config) -> dict[str, Any]:
    """config.json's window keys of our model: the inverse of window_fields."""
    window = cfg.model.sliding_window
    return {"use_sliding_window": window is not None, "sliding_window": window}


def model_fields(config: ConfigJson) -> dict[str, Any]:
    fields = qwen3.qwen3_fields(config, "qwen3_moe", DEFAULTS, window_fields)
    if not config.get("norm_topk_prob", False):
        raise config.refuse(
            "norm_topk_prob false (the top-k router weights not renormalized) is not supported; "
            "supported: true (model.moe.router softmax_topk)"
        )
    moe = MoEConfig(
        num_experts=num_experts_of(config),
        top_k=config.get("num_experts_per_tok", 8),
        d_ff=config.get("moe_intermediate_size", 768),
        every=moe_every(config, fields["n_layer"]),
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        z_loss_coef=0.0,  # Qwen3-MoE has none
        router="softmax_topk",
    )
    return dict(fields, moe=moe)


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    """Qwen3's keys with the experts'; a UserError for a shared expert or a router the class
    does not have."""
    moe = cfg.model.moe
    if moe.shared_expert or moe.n_shared_experts:
        key = "shared_expert" if moe.shared_expert else "n_shared_experts"
        raise UserError(
            f"model.moe.{key}: Qwen3MoeForCausalLM (export --format hf) has no shared "
            "expert; valid for export: model.moe.shared_expert=false, model.moe.n_shared_experts=0"
        )
    if moe.router == "sigmoid":
        raise UserError(
            "model.moe.router: Qwen3MoeForCausalLM (export --format hf) routes by softmax top-k; "
            "valid for export: softmax_topk or topk_softmax"
        )
    sparse = moe_layers(cfg)
    return dict(
        qwen3.qwen3_json(cfg, derived, "Qwen3MoeForCausalLM", "qwen3_moe", window_json),
        moe_intermediate_size=derived.moe_d_ff,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg.model.n_layer) if i not in sparse],
        router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=False,
    )


def mlp_names(sparse: tuple[int, ...], num_experts: int) -> llama.MlpNames:
    """Block i's MLP names: the router's and experts' in the blocks `sparse`, else dense."""
    experts: Names = expert_names("mlp.gate", "mlp.experts.", EXPERT, num_experts)
    return lambda i: experts if i in sparse else llama.DENSE_MLP


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    names = mlp_names(derived.moe_layers, cfg.model.moe.num_experts)
    return llama.tensors_to_hf(cfg, derived, ours, names)


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    moe, n_layer = fields["moe"], fields["n_layer"]
    sparse = tuple(range(0, n_layer, moe.every))
    for i in sparse:
        experts = f"model.layers.{i}.mlp.experts."
        unfuse_experts(hf, experts, tuple(theirs for _, theirs in EXPERT), experts)
    return llama.tensors_from_hf(hf, fields, mlp_names(sparse, moe.num_experts))


FAMILY = Family(
    name="Qwen3-MoE",
    architectures=("Qwen3MoeForCausalLM",),
    model_type="qwen3_moe",
    arch="qwen3_moe",
    components={**qwen3.COMPONENTS, **llama.EVERY_BLOCK_SLIDES, "experts": True},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
