"""A mixture-of-experts MLP (megatronish.moe.layer): the router (d_model x num_experts,
replicated), num_experts SwiGLU experts of moe_d_ff split over ep and tp, and the shared
experts (a SwiGLU MLP of shared_d_ff, split over tp)."""

from __future__ import annotations

from megatronish.config import Config, Derived

EXPERT_WEIGHTS = 3
"""Weights of an expert (and of a shared expert): gate, up and down."""

SHARED_KEEPS_GATHERED = True
"""A shared expert's gate and up share one gather under sequence parallelism and keep it
(layers.linear.shared_input_linears)."""


def parameters(cfg: Config, derived: Derived, active: bool = False) -> int:
    """Parameters of one MoE MLP: the router, every expert (active: the top_k a token goes
    through) and the shared experts (the sigmoid router's routing bias is state, not a
    trained parameter: not counted)."""
    moe, h, f = cfg.model.moe, cfg.model.d_model, derived.moe_d_ff
    experts = moe.top_k if active else moe.num_experts
    shared = EXPERT_WEIGHTS * h * derived.shared_d_ff
    return moe.num_experts * h + experts * EXPERT_WEIGHTS * h * f + shared


def local_parameters(cfg: Config, derived: Derived, experts_only: bool = False) -> int:
    """Parameters of one MoE MLP on one rank: the router, its num_experts / ep experts (each
    f / t wide) and the shared experts (experts_only: its experts alone)."""
    moe, h = cfg.model.moe, cfg.model.d_model
    f_local = derived.moe_d_ff // derived.tp
    experts = moe.num_experts // derived.ep * EXPERT_WEIGHTS * h * f_local
    if experts_only:
        return experts
    return moe.num_experts * h + experts + EXPERT_WEIGHTS * h * derived.shared_d_ff // derived.tp


def activation_elements(T: int, f: int) -> int:
    """Elements the experts' SwiGLU reads and writes forward on T tokens f wide: read 2, write
    1."""
    return T * f * 3
