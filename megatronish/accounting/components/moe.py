"""A mixture-of-experts MLP (megatronish.moe.layer): the router (d_model x num_experts,
replicated, and its logits' bias with biased_experts), num_experts SwiGLU experts of moe_d_ff
split over ep and tp (with biased_experts each with gate and up biases of moe_d_ff and a down
bias of d_model, all split over tp), and the shared experts (a SwiGLU MLP of shared_d_ff, split
over tp) with their sigmoid gate where model.moe.shared_expert_gate (d_model x 1,
replicated)."""

from __future__ import annotations

from typing import NamedTuple

from megatronish.config import Config, Derived

EXPERT_WEIGHTS = 3
"""Weights of an expert (and of a shared expert): gate, up and down."""

SHARED_KEEPS_GATHERED = True
"""A shared expert's gate and up share one gather under sequence parallelism and keep it
(layers.linear.shared_input_linears)."""


def router_params(cfg: Config) -> int:
    """Parameters replicated on every tp rank of one MoE MLP: the router and the shared
    experts' gate (model.moe.shared_expert_gate), and the router's logit bias (biased_experts)."""
    moe, h = cfg.model.moe, cfg.model.d_model
    bias = moe.num_experts if cfg.model.components.biased_experts else 0
    return (moe.num_experts + int(moe.shared_expert_gate)) * h + bias


def expert_params(cfg: Config, h: int, f: int, tp: int = 1) -> int:
    """Parameters of one expert of f on one of tp ranks: its three weights (f / t wide) and,
    with biased_experts, its gate and up biases (f / t) and its down bias (h / t)."""
    biases = 2 * f // tp + h // tp if cfg.model.components.biased_experts else 0
    return EXPERT_WEIGHTS * h * (f // tp) + biases


def parameters(cfg: Config, derived: Derived, active: bool = False) -> int:
    """Parameters of one MoE MLP: the router, every expert (active: the top_k a token goes
    through), the shared experts and their gate (the sigmoid router's routing bias is state, not a
    trained parameter: not counted)."""
    moe, h, f = cfg.model.moe, cfg.model.d_model, derived.moe_d_ff
    experts = moe.top_k if active else moe.num_experts
    shared = EXPERT_WEIGHTS * h * derived.shared_d_ff
    return router_params(cfg) + experts * expert_params(cfg, h, f) + shared


def local_parameters(cfg: Config, derived: Derived, experts_only: bool = False) -> int:
    """Parameters of one MoE MLP on one rank: the router, its num_experts / ep experts (each
    f / t wide), the shared experts and their gate (experts_only: its experts alone)."""
    moe, h = cfg.model.moe, cfg.model.d_model
    local = moe.num_experts // derived.ep
    experts = local * expert_params(cfg, h, derived.moe_d_ff, derived.tp)
    if experts_only:
        return experts
    shared = EXPERT_WEIGHTS * h * derived.shared_d_ff // derived.tp
    return router_params(cfg) + experts + shared


class Gemm(NamedTuple):
    """A forward GEMM [m, k] x [k, n], `batch` of them in one kernel, fp8 under train.precision
    fp8 or not."""

    m: int
    n: int
    k: int
    batch: int
    fp8: bool


def routed_gemms(cfg: Config, derived: Derived, T: int) -> list[Gemm]:
    """The forward GEMMs of T tokens on one rank: the router [T, h] x [h, E] (in high
    precision), and the T top_k routed rows through its E / ep experts (fp8 under fp8), each
    [rows, h] x [h, f / t] for gate and up and [rows, f / t] x [f / t, h] for down, the rows
    per expert dropless on average."""
    moe, h = cfg.model.moe, cfg.model.d_model
    f, local = derived.moe_d_ff // derived.tp, moe.num_experts // derived.ep
    rows = max(1, T * moe.top_k * derived.ep // moe.num_experts)
    experts = [Gemm(rows, f, h, local, True)] * 2 + [Gemm(rows, h, f, local, True)]
    return [Gemm(T, moe.num_experts, h, 1, False), *experts]


def shared_gemms(cfg: Config, derived: Derived, T: int) -> list[tuple[int, int, int]]:
    """(rows, columns, inner) of the shared experts' forward GEMMs of T tokens on one tp rank,
    a SwiGLU MLP shared_d_ff wide: gate and up, down (none without shared experts)."""
    if not derived.shared_d_ff:
        return []
    f, h = derived.shared_d_ff // derived.tp, cfg.model.d_model
    return [(T, 2 * f, h), (T, h, f)]


def permuted_elements(cfg: Config, T: int) -> int:
    """Elements of the T top_k routed rows the layer permutes out to the experts and back."""
    return T * cfg.model.moe.top_k * cfg.model.d_model


def activation_elements(T: int, f: int) -> int:
    """Elements the experts' SwiGLU reads and writes forward on T tokens f wide: read 2, write
    1."""
    return T * f * 3
