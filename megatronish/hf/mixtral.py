"""Mixtral (MixtralForCausalLM): a Llama whose every MLP is a mixture of experts; export writes
a model.arch llama with experts as it. Our router is its block_sparse_moe.gate; expert e's
gate, down and up are its experts.<e>.w1, w2 and w3, the names of the Hub's Mixtral checkpoints
(transformers' fused in-memory layout, mlp.experts.gate_up_proj and down_proj, is read too).
Our softmax_topk router gives the same weights as Mixtral's softmax, top-k, renormalize."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived, MoEConfig
from megatronish.errors import UserError
from megatronish.hf import llama
from megatronish.hf.family import ConfigJson, Family, Names, Tensors, unfuse_experts

# Our expert weight -> its name in the Hub's Mixtral checkpoints (w1 gate, w2 down, w3 up).
EXPERT = (("gate", "w1"), ("down", "w2"), ("up", "w3"))
DEFAULTS = llama.ClassDefaults(kv_heads=8, max_positions=4096 * 32, norm_eps=1e-5, rope_theta=1e6)


def expert_names(router: str, experts: str, names: Names, num_experts: int) -> Names:
    """A block's router and every expert's (our name, theirs): theirs router + ".weight", and
    experts + "<e>.<name>.weight" for each (our weight, its name) in `names`."""
    out = [("mlp.router.weight", f"{router}.weight")]
    for e in range(num_experts):
        out += [
            (f"mlp.experts.{e}.{ours}.weight", f"{experts}{e}.{theirs}.weight")
            for ours, theirs in names
        ]
    return out


def mlp_names(num_experts: int) -> Names:
    """The router's and every expert's (our name, theirs) in one block."""
    return expert_names("block_sparse_moe.gate", "block_sparse_moe.experts.", EXPERT, num_experts)


def num_experts_of(config: ConfigJson) -> int:
    """config.json's experts per block: num_local_experts, or num_experts (the name Mixtral's
    and Qwen3-MoE's classes both map to it)."""
    for key in ("num_local_experts", "num_experts"):
        if config.get(key) is not None:
            return config.get(key)
    return config.need("num_experts")


def model_fields(config: ConfigJson) -> dict[str, Any]:
    fields = dict(
        llama.block_fields(config, "llama", DEFAULTS, llama.PLAIN),
        **llama.window_fields(config, "sliding_window", config.get("sliding_window")),
    )
    moe = MoEConfig(
        num_experts=num_experts_of(config),
        top_k=config.get("num_experts_per_tok", 2),
        d_ff=fields["d_ff"],
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        z_loss_coef=0.0,  # Mixtral has none
        router="softmax_topk",
    )
    return dict(fields, moe=moe)


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
        llama.block_json(cfg, derived, "MixtralForCausalLM", "mixtral"),
        intermediate_size=derived.moe_d_ff,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        router_aux_loss_coef=moe.aux_loss_coef,
        router_jitter_noise=0.0,
        output_router_logits=False,
        sliding_window=cfg.model.sliding_window,
    )


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    names = mlp_names(cfg.model.moe.num_experts)
    return llama.tensors_to_hf(cfg, derived, ours, lambda i: names)


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    for i in range(fields["n_layer"]):
        block = f"model.layers.{i}."
        fused = unfuse_experts(
            hf, block + "mlp.experts.", ("w1", "w3", "w2"), block + "block_sparse_moe.experts."
        )
        if fused and block + "mlp.gate.weight" in hf:
            hf[block + "block_sparse_moe.gate.weight"] = hf.pop(block + "mlp.gate.weight")
    names = mlp_names(fields["moe"].num_experts)
    return llama.tensors_from_hf(hf, fields, lambda i: names)


FAMILY = Family(
    name="Mixtral",
    architectures=("MixtralForCausalLM",),
    model_type="mixtral",
    arch="llama",
    components={**llama.PLAIN, **llama.EVERY_BLOCK_SLIDES, "experts": True},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=(*llama.TRAINING_ONLY, ("router_jitter_noise", 0.0)),
)
