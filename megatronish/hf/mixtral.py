"""Mixtral (MixtralForCausalLM): a Llama whose every MLP is a mixture of experts. Our router is
its block_sparse_moe.gate; expert e's gate, down and up are its experts.<e>.w1, w2 and w3, the
names of the Hub's Mixtral checkpoints. Our softmax_topk router gives the same weights as
Mixtral's softmax, top-k, renormalize."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived, MoEConfig
from megatronish.errors import UserError
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family, Names, Tensors

# Our expert weight -> its name in the Hub's Mixtral checkpoints (w1 gate, w2 down, w3 up).
EXPERT = (("gate", "w1"), ("down", "w2"), ("up", "w3"))


def mlp_names(num_experts: int) -> Names:
    """The router's and every expert's (our name, theirs) in one block."""
    names = [("mlp.router.weight", "block_sparse_moe.gate.weight")]
    for e in range(num_experts):
        for ours, theirs in EXPERT:
            names.append(
                (f"mlp.experts.{e}.{ours}.weight", f"block_sparse_moe.experts.{e}.{theirs}.weight")
            )
    return names


def model_fields(config: ConfigJson) -> dict[str, Any]:
    moe = MoEConfig(
        num_experts=config.need("num_local_experts"),
        top_k=config.need("num_experts_per_tok"),
        d_ff=config.need("intermediate_size"),
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.01)),
        router="softmax_topk",
    )
    return dict(llama.model_fields(config), moe=moe)


def exports(cfg: Config, derived: Derived) -> bool:
    return cfg.model.arch == "llama" and bool(derived.moe_layers)


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    """Llama's keys with Mixtral's; a UserError for an MoE that Mixtral cannot express."""
    moe = cfg.model.moe
    for bad, key, valid in (
        (moe.every != 1, "model.moe.every", "1 (an MoE MLP in every block)"),
        (moe.shared_expert, "model.moe.shared_expert", "false"),
        (moe.n_shared_experts > 0, "model.moe.n_shared_experts", "0"),
        (moe.first_k_dense > 0, "model.moe.first_k_dense", "0"),
        (moe.router == "sigmoid", "model.moe.router", "softmax_topk"),
    ):
        if bad:
            raise UserError(
                f"{key}: Mixtral (export --format hf) has no equivalent of "
                f"{getattr(moe, key.rpartition('.')[2])!r}; valid for export: {valid}"
            )
    return dict(
        llama.config_json(cfg, derived),
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=derived.moe_d_ff,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        router_jitter_noise=0.0,
        output_router_logits=False,
        sliding_window=None,
    )


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    return llama.tensors_to_hf(cfg, derived, ours, mlp_names(cfg.model.moe.num_experts))


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    return llama.tensors_from_hf(hf, fields, mlp_names(fields["moe"].num_experts))


FAMILY = Family(
    architectures=("MixtralForCausalLM",),
    model_type="mixtral",
    model_fields=model_fields,
    exports=exports,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
)
