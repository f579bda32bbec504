"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, the text model: Qwen3_5MoeTextConfig, model_type
qwen3_5_moe_text): Qwen3.5's blocks (megatronish.hf.qwen3_5) with a mixture of experts in every
block: num_experts experts of moe_intermediate_size routed by softmax top-k, renormalized (our
softmax_topk), and a shared expert of shared_expert_intermediate_size (a multiple of
moe_intermediate_size: model.moe.n_shared_experts, or shared_expert for one) under a sigmoid
gate (model.moe.shared_expert_gate). Expert e of a block is its mlp.experts.<e>.gate_proj /
up_proj / down_proj as save_pretrained writes them (transformers' fused mlp.experts.gate_up_proj
and down_proj are read too); the router is its mlp.gate, the shared expert its
mlp.shared_expert and the gate its mlp.shared_expert_gate. The class has no dense MLP."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived, MoEConfig, moe_layers
from megatronish.errors import UserError
from megatronish.hf import llama, qwen3_5
from megatronish.hf.family import ConfigJson, Family, Names, Tensors, unfuse_experts
from megatronish.hf.mixtral import expert_names
from megatronish.hf.qwen3_moe import EXPERT

DEFAULTS = llama.ClassDefaults(kv_heads=2, head_dim=256, max_positions=32768)
D_FF = 512  # moe_intermediate_size and shared_expert_intermediate_size's default
SHARED: Names = (
    *(
        (f"mlp.shared.{ours}.weight", f"mlp.shared_expert.{theirs}.weight")
        for ours, theirs in EXPERT
    ),
    ("mlp.shared_gate.weight", "mlp.shared_expert_gate.weight"),
)


def model_fields(config: ConfigJson, experts: tuple[int, int] = (256, 8)) -> dict[str, Any]:
    """Our model.* settings: Qwen3.5's blocks, every MLP experts and a gated shared expert
    (experts: the class's defaults of num_experts and num_experts_per_tok)."""
    d_ff = config.get("moe_intermediate_size", D_FF)
    shared = config.get("shared_expert_intermediate_size", D_FF)
    if not shared or shared % d_ff:
        raise config.refuse(
            f"shared_expert_intermediate_size {shared} is not supported; supported: a positive "
            f"multiple of moe_intermediate_size ({d_ff})"
        )
    blocks = ConfigJson(dict(config.raw, intermediate_size=d_ff), config.path)
    fields = qwen3_5.model_fields(blocks, DEFAULTS)
    moe = MoEConfig(
        num_experts=config.get("num_experts", experts[0]),
        top_k=config.get("num_experts_per_tok", experts[1]),
        d_ff=d_ff,
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        z_loss_coef=0.0,  # Qwen3.5-MoE has none
        router="softmax_topk",
        # one shared expert as the preset has it (shared_expert), else n_shared_experts
        shared_expert=shared == d_ff,
        n_shared_experts=0 if shared == d_ff else shared // d_ff,
        shared_expert_gate=True,
    )
    return dict(fields, moe=moe)


def experts_json(
    cfg: Config, derived: Derived, architecture: str, model_type: str, dense_blocks: bool
) -> dict[str, Any]:
    """Qwen3.5's keys with the experts' as `architecture` (Qwen3-Next's too: dense_blocks, its
    class has dense MLPs beside the experts); a UserError for a model the class cannot
    express."""
    moe = cfg.model.moe
    dense = [i for i in range(cfg.model.n_layer) if i not in moe_layers(cfg)]
    every = "experts and a gated shared expert" + ("" if dense_blocks else " in every block")
    for refused, setting, valid in (
        (
            dense and not dense_blocks,
            f"model.moe.every={moe.every}, first_k_dense={moe.first_k_dense}",
            "1 and 0",
        ),
        (not derived.shared_d_ff, "model.moe.shared_expert=false", "true"),
        (not moe.shared_expert_gate, "model.moe.shared_expert_gate=false", "true"),
        (moe.router == "sigmoid", "model.moe.router=sigmoid", "softmax_topk or topk_softmax"),
    ):
        if refused:
            raise UserError(
                f"{setting}: {architecture} (export --format hf) has {every}, routed by "
                f"softmax top-k; valid for export: {valid}"
            )
    out = qwen3_5.config_json(cfg, derived, architecture, model_type)
    return dict(
        out,
        moe_intermediate_size=derived.moe_d_ff,
        shared_expert_intermediate_size=derived.shared_d_ff,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        output_router_logits=False,
    )


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    out = experts_json(cfg, derived, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", False)
    del out["intermediate_size"]  # the class has no dense MLP
    return out


def mlp_names(num_experts: int) -> llama.MlpNames:
    """Every block's MLP names: the router's, the experts', the shared expert's and its gate's."""
    names = (*expert_names("mlp.gate", "mlp.experts.", EXPERT, num_experts), *SHARED)
    return lambda i: names


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    return qwen3_5.tensors_to_hf(cfg, derived, ours, mlp_names(cfg.model.moe.num_experts))


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    for i in range(fields["n_layer"]):
        experts = f"model.layers.{i}.mlp.experts."
        unfuse_experts(hf, experts, tuple(theirs for _, theirs in EXPERT), experts)
    return qwen3_5.tensors_from_hf(hf, fields, mlp_names(fields["moe"].num_experts))


FAMILY = Family(
    name="Qwen3.5-MoE",
    architectures=("Qwen3_5MoeForCausalLM",),
    model_type="qwen3_5_moe_text",
    arch="qwen3_5",
    components={**qwen3_5.FAMILY.components, "experts": True, "dense_blocks": False},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
