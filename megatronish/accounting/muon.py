"""Muon's costs (optim.name muon, megatronish.optim.muon), from the same components as the
model: the logical matrices it takes per block (optim.muon_matrices builds the same list from a
model), the momentum it keeps (one fp32 buffer per matrix element, AdamW's two for the rest),
the Newton-Schulz FLOPs per matrix and step, and the all-gathers of the matrices split over tp
(each whole matrix in bf16, every step).

Newton-Schulz on an [m, n] matrix, m <= n (a tall one is transposed): per iteration X X^T
(2 m^2 n), the quintic term B = b A + c A A (2 m^3) and B X (2 m^2 n): ns_steps (4 m^2 n +
2 m^3). Every tp rank that holds a shard of a matrix runs the iteration on the whole of it.
"""

from __future__ import annotations

from typing import NamedTuple

from megatronish.accounting.components import attention, attention_at, gated_deltanet, mla
from megatronish.accounting.hardware import Device
from megatronish.accounting.parameters import mtp_blocks, stage_blocks
from megatronish.accounting.roofline import Efficiency, gemm_time
from megatronish.config import Config, Derived
from megatronish.config.mla_shapes import mla_shapes
from megatronish.config.optim_checks import muon_settings

BF16_BYTES = 2
STATE_LABEL = {"adamw": "AdamW", "muon": "Muon + AdamW"}
"""How check and plan name the optimizer state of each optim.name."""


class MuonMatrix(NamedTuple):
    """`count` logical matrices of full shape [rows, cols] on one rank (named by the module
    that holds them), split over tp (gathered whole each step) or replicated; `count` is an
    average over the ranks where it varies (``owned_matrices``)."""

    name: str
    rows: int
    cols: int
    split: bool
    count: float = 1


def block_matrices(cfg: Config, derived: Derived, index: int) -> list[MuonMatrix]:
    """The matrices Muon takes in block `index` on one rank (its experts: num_experts / ep)."""
    return _mixer(cfg, derived, index) + _mlp(cfg, derived, index in derived.moe_layers)


def _mixer(cfg: Config, derived: Derived, index: int) -> list[MuonMatrix]:
    model, h = cfg.model, cfg.model.d_model
    kind = attention_at(model, index)
    if kind is mla:
        s = mla_shapes(model)
        if s.q_rank is None:
            q = [MuonMatrix("attn.q", s.q_out, h, True)]
        else:
            q_b = MuonMatrix("attn.q_b", s.q_out, s.q_rank, True)
            q = [MuonMatrix("attn.q_a", s.q_rank, h, False), q_b]
        kv_b = MuonMatrix("attn.kv_b", s.kv_b_out, s.kv_rank, True)
        return [*q, MuonMatrix("attn.kv_a", s.latent, h, False), kv_b] + [
            MuonMatrix("attn.proj", h, s.proj_in, True)
        ]
    if kind is gated_deltanet:
        keys = model.linear_num_key_heads * model.linear_key_head_dim
        values = model.linear_num_value_heads * model.linear_value_head_dim
        heads = model.linear_num_value_heads
        shapes = [("attn.q", keys, h), ("attn.k", keys, h), ("attn.v", values, h)]
        shapes += [("attn.z", values, h), ("attn.b", heads, h), ("attn.a", heads, h)]
        return [MuonMatrix(*m, True) for m in [*shapes, ("attn.out_proj", h, values)]]
    assert kind is attention
    queries, kv = model.n_head * derived.head_dim, derived.n_kv_head * derived.head_dim
    gates = [("attn.gate", queries, h)] if model.components.attention_gate else []
    shapes = [("attn.q", queries, h), *gates, ("attn.k", kv, h), ("attn.v", kv, h)]
    return [MuonMatrix(*m, True) for m in [*shapes, ("attn.proj", h, queries)]]


def _mlp(cfg: Config, derived: Derived, moe: bool) -> list[MuonMatrix]:
    h = cfg.model.d_model
    if not moe:
        return _ffn("mlp", h, derived.d_ff, cfg.model.components.gated_mlp)
    experts = cfg.model.moe.num_experts // derived.ep
    routed = [m._replace(count=experts) for m in _ffn("experts", h, derived.moe_d_ff, True)]
    shared = _ffn("shared", h, derived.shared_d_ff, True) if derived.shared_d_ff else []
    return routed + shared


def _ffn(name: str, h: int, f: int, gated: bool) -> list[MuonMatrix]:
    first = [f"{name}.gate", f"{name}.up"] if gated else [f"{name}.up"]
    return [MuonMatrix(n, f, h, True) for n in first] + [MuonMatrix(f"{name}.down", h, f, True)]


def stage_matrices(cfg: Config, derived: Derived, pp_rank: int) -> list[MuonMatrix]:
    """Every matrix Muon takes on one rank of stage pp_rank (none under optim.name adamw): its
    blocks' and, on the last stage, the multi-token prediction modules' (eh_proj [h, 2h],
    replicated, and their blocks)."""
    if cfg.optim.name != "muon":
        return []
    out = [m for i in stage_blocks(derived, pp_rank) for m in block_matrices(cfg, derived, i)]
    h = cfg.model.d_model
    for i in mtp_blocks(cfg, derived, pp_rank):
        out += [MuonMatrix("mtp.eh_proj", h, 2 * h, False), *block_matrices(cfg, derived, i)]
    return out


def local_elements(matrices: list[MuonMatrix], tp: int) -> int:
    """The elements of these matrices one tp rank holds (its momentum buffer's)."""
    return sum(m.count * m.rows * m.cols // (tp if m.split else 1) for m in matrices)


def whole_under_zero(cfg: Config, derived: Derived, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) elements of stage pp_rank's Muon matrices on one rank that ZeRO 1 to 3
    leave out of its buffer (0, 0 at optim.zero 0): each parameter whole, owned by one rank of
    its group (the expert-data-parallel group for the experts), to which its gradient is reduced
    and which keeps its momentum and broadcasts it after the step (data_parallel.zero1, the
    layer-wise way)."""
    if cfg.optim.zero == 0:
        return 0, 0
    matrices = stage_matrices(cfg, derived, pp_rank)
    experts = local_elements([m for m in matrices if m.name.startswith("experts.")], derived.tp)
    return local_elements(matrices, derived.tp) - experts, experts


def owned_matrices(cfg: Config, derived: Derived, pp_rank: int) -> list[MuonMatrix]:
    """The matrices one rank of stage pp_rank updates: every one at optim.zero 0; under ZeRO the
    share it owns (data_parallel.zero1: each parameter whole on one rank of its group, balanced
    by size), counted as the group's average (count / dp x cp, the experts' / their group)."""
    matrices = stage_matrices(cfg, derived, pp_rank)
    dp = derived.dp * derived.cp
    if cfg.optim.zero == 0 or dp == 1:
        return matrices
    edp = max(1, dp // derived.ep)
    share = {True: edp, False: dp}
    return [m._replace(count=m.count / share[m.name.startswith("experts.")]) for m in matrices]


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of `steps` Newton-Schulz iterations on a [rows, cols] matrix (module doc)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def step_flops(cfg: Config, matrices: list[MuonMatrix]) -> int:
    """Newton-Schulz FLOPs of one optimizer step on one rank (each matrix whole)."""
    steps = muon_settings(cfg).ns_steps
    return sum(m.count * newton_schulz_flops(m.rows, m.cols, steps) for m in matrices)


def gather_payload(matrices: list[MuonMatrix], tp: int) -> int:
    """Bytes of the step's tp all-gathers on one rank (each split matrix whole, bf16); this rank
    sends (tp - 1) / tp of them."""
    if tp == 1:
        return 0
    return sum(m.count * m.rows * m.cols * BF16_BYTES for m in matrices if m.split)


def newton_schulz_seconds(
    cfg: Config, derived: Derived, pp_rank: int, device: Device, eff: Efficiency
) -> float:
    """The step-time model's Newton-Schulz on one rank of stage pp_rank: each matrix's
    iterations as bf16 GEMMs (accounting.roofline.gemm_time) on the matrices it owns
    (``owned_matrices``); the gathers are tp collectives
    (accounting.collectives.muon)."""
    steps, seconds = muon_settings(cfg).ns_steps, 0.0
    for matrix in owned_matrices(cfg, derived, pp_rank):
        m, n = min(matrix.rows, matrix.cols), max(matrix.rows, matrix.cols)
        gemms = [(m, m, n), (m, m, m), (m, n, m)]  # X X^T, A A, B X
        once = sum(gemm_time(*g, device, BF16_BYTES, eff)[0] for g in gemms)
        seconds += matrix.count * steps * once
    return seconds
