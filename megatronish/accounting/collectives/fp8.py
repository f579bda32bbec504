"""FP8 (train.precision): the amax all-reduces (MAX, fp32) of the scales whose groups of elements
span ranks, one call per GEMM that has any (megatronish.fp8.quantize), over the ranks that
split them: tp (a sharded weight, rows split along K), cp (tokens split over the context
ranks) or tp x cp where a GEMM's operands need both (an operand replicated over the other
reduces to its own amax there).

Per micro-batch, in every block's attention (qkv column-parallel, projection row-parallel;
multi-head latent attention's q or q_b and kv_b column-parallel, its down-projections not fp8; a
linear-attention block's four input projections column-parallel, out_proj row-parallel),
dense MLP or MoE layer's shared experts (up and gate column-parallel; down row-parallel), with
T = b s the GEMMs' tokens (a cp rank's share), out and in the layer's full sizes:

- tensorwise: forward, a column layer's weight (tp) and input (cp), a row layer's input (tp,
  cp) and weight (tp): one value each; backward, the output gradient's (a column layer's: tp,
  cp; a row layer's: cp). The weight-gradient GEMM reuses the scales.
- rowwise: over tp a column layer's output-gradient rows and weight columns (T + in) in the
  input-gradient GEMM, one each per logical matrix of its rows (the qkv's q, k and v: 3 (T +
  in), with Qwen3.5's output gate 4; megatronish.fp8.parts), and a row layer's input and weight
  rows (T + out) in the forward; over cp the weight-gradient GEMM's per-feature scales over the
  tokens (out / t + in, or out + in / t), which a LoRA run's frozen weights do not run.
- blockwise: none (a shard holds whole tiles and blocks: config.derive).

An MoE layer's routed experts (gate and up column-split, down row-split over tp; E_l = E / ep
on a rank, rows from S = ep source ranks: megatronish.fp8.grouped) make the same calls with
a value per (expert, source) run where a linear layer has one per tensor, and per expert weight:
tensorwise E_l S for an input or output gradient, E_l for a weight; rowwise the rows the rank
received where a linear layer has its T tokens (T k on average, the number counted here: dropless
the ranks' counts sum to the formula's, as the all-to-all's do) and E_l times the weight's rows,
and E_l S times the per-feature scales of the weight-gradient GEMM.

The weight's scales are taken once a step (megatronish.fp8.gemm caches its casts until the
optimizer changes it): they join the first micro-batch's call of their GEMM, and its other
runs (later micro-batches, a full recompute's rerun) reduce the activation's alone.

Full recompute reruns the forward ones.

Under parallel.tp_comm_overlap with sequence parallelism (megatronish.layers.overlap) the
scales are the same, but a gathered tensor's tensorwise amax is reduced from its sequence chunks
before the ring: a column layer's forward (its input: tp, cp; llama's gate and up in one call
with both weights) and a row layer's input gradient (its output gradient: tp, cp) reduce one
value every run. The routed experts do not run on the ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megatronish.accounting.collectives.step import FP32_BYTES, Collective, Purpose, Step
from megatronish.accounting.components import attention, gated_deltanet, mlp
from megatronish.config import TrainConfig
from megatronish.config.mla_shapes import mla_shapes
from megatronish.fp8 import RECIPES
from megatronish.layers.plan import Format, numeric_format


def fp8_collectives(step: Step) -> list[Collective]:
    """The fp8 scales' amax all-reduces of the stage's blocks in one step (module doc)."""
    train = step.cfg.train
    if train.precision != "fp8" or train.fp8_recipe == "blockwise":
        return []
    forward_runs = 2 if train.activation_checkpointing == "full" else 1
    ops = []
    for layer in _layers(step):
        n = layer.calls
        if not n:
            continue
        for g in _gemms(step, layer, forward_runs):
            calls = n * step.accum * g.runs  # the GEMM's calls a step
            what = f"fp8 amax of {layer.name} ({g.gemm})"
            if g.weight_values:  # the first run's calls take the weights' too
                both = f"{what}, with the weight's"
                axes, values = g.axes | g.weight_axes, g.values + g.weight_values
                ops.append(_over(step, both, axes, values, n * g.firsts))
                calls -= n * g.firsts
            if g.values:
                ops.append(_over(step, what, g.axes, g.values, calls))
    return ops


class AmaxLayer(NamedTuple):
    """A layer whose GEMMs run in fp8, as the amax count sees it."""

    name: str
    column: bool
    """Column-parallel (else row-parallel)."""
    out: int
    inner: int
    calls: int
    """Calls of its forward GEMM per micro-batch."""
    weights: int
    """Weights one call takes (gate and up decomposed on the ring: 2)."""
    group: Group


def _layers(step: Step) -> list[AmaxLayer]:
    """The stage's fp8 layers, per micro-batch: gate and up are one decomposed GEMM of the
    gathered input on the tp ring, else one each."""
    model, derived, h = step.cfg.model, step.derived, step.h
    dense = step.layers - step.moe_layers
    shared = step.moe_layers if derived.shared_d_ff else 0
    ring = step.sp and step.overlap
    gates = mlp.first_weights(model)  # weights of the MLP's first projection
    each, weights = (1, gates) if ring else (gates, 1)  # calls of it and weights a call takes
    up = mlp.first_name(model)
    tokens = step.b * step.s
    linear = Group(1, 1, tokens, ring)
    experts = model.moe.num_experts // derived.ep
    routed = Group(experts * derived.ep, experts, tokens * model.moe.top_k, False)
    return [
        *_attention_layers(step, linear),
        *_linear_attention_layers(step, linear),
        AmaxLayer(up, True, derived.d_ff, h, each * dense, weights, linear),
        AmaxLayer("MLP down", False, h, derived.d_ff, dense, 1, linear),
        AmaxLayer(
            "shared experts up and gate",
            True,
            derived.shared_d_ff,
            h,
            each * shared,
            weights,
            linear,
        ),
        AmaxLayer("shared experts down", False, h, derived.shared_d_ff, shared, 1, linear),
        AmaxLayer("experts up and gate", True, derived.moe_d_ff, h, 2 * step.moe_layers, 1, routed),
        AmaxLayer("experts down", False, h, derived.moe_d_ff, step.moe_layers, 1, routed),
    ]


def _attention_layers(step: Step, linear: Group) -> list[AmaxLayer]:
    """The full-attention blocks' fp8 layers: the column-parallel qkv (its rows' q, (gate,) k
    and v) or, under multi-head latent attention, q (q_b after the query latent) and kv_b (the
    latents' replicated down-projections are not fp8; q_b and kv_b take them whole, off the
    ring); and the row-parallel projection of the heads' values."""
    model, derived, h = step.cfg.model, step.derived, step.h
    full = step.layers - step.linear_layers
    proj = AmaxLayer("attention projection", False, h, model.n_head * derived.v_head_dim, full,
                     1, linear)  # fmt: skip
    if model.components.attention != "mla":
        qkv = attention.qkv_heads(model, derived) * derived.head_dim
        rows = Group(1, 1, linear.rows, linear.ring, parts=attention.qkv_parts(model))
        return [AmaxLayer("qkv", True, qkv, h, full, 1, rows), proj]
    shapes, whole = mla_shapes(model), Group(1, 1, linear.rows, False)
    if shapes.q_rank is None:
        q = AmaxLayer("q", True, shapes.q_out, h, full, 1, linear)
    else:
        q = AmaxLayer("q_b", True, shapes.q_out, shapes.q_rank, full, 1, whole)
    return [q, AmaxLayer("kv_b", True, shapes.kv_b_out, shapes.kv_rank, full, 1, whole), proj]


def _linear_attention_layers(step: Step, linear: Group) -> list[AmaxLayer]:
    """A linear-attention block's fp8 layers (accounting.components.gated_deltanet): its four
    column-parallel input projections, one call each (in_proj_qkv's rows of q, k and v per key
    head), and the row-parallel out_proj."""
    model, n, h = step.cfg.model, step.linear_layers, step.h
    values = model.linear_num_value_heads
    width = values * model.linear_value_head_dim
    qkv = Group(1, 1, linear.rows, linear.ring, parts=gated_deltanet.QKV_PARTS)
    return [
        AmaxLayer("linear attention in_proj_qkv", True, gated_deltanet.conv_channels(model), h, n,
                  1, qkv),
        AmaxLayer("linear attention in_proj_z", True, width, h, n, 1, linear),
        AmaxLayer("linear attention in_proj_b", True, values, h, n, 1, linear),
        AmaxLayer("linear attention in_proj_a", True, values, h, n, 1, linear),
        AmaxLayer("linear attention out_proj", False, h, width, n, 1, linear),
    ]  # fmt: skip


@dataclass(frozen=True)
class Group:
    """How a GEMM's rows are scaled: `runs` groups of rows (a linear layer: 1 tensor; experts:
    one per (expert, source)), `weights` weights (experts: one per local expert), `rows` rows
    (a linear layer's tokens; the experts': the routed rows, on average), whether its GEMMs
    run decomposed on the tp ring (parallel.tp_comm_overlap with sequence parallelism), and the
    logical matrices of its output rows (the qkv's q, k and v; megatronish.fp8.parts)."""

    runs: int
    weights: int
    rows: int
    ring: bool
    parts: int = 1


class AmaxGemm(NamedTuple):
    """One GEMM of a layer that reduces amaxes."""

    gemm: str
    """"forward", "input gradient" or "weight gradient"."""
    axes: set[str]
    values: int
    """The axes and the number of values of its activation's (or output gradient's) amaxes."""
    weight_axes: set[str]
    weight_values: int
    """Those of the weights' amaxes, taken by the first run's calls."""
    runs: int
    """Calls per micro-batch and layer call."""
    firsts: int
    """Of which the first run's, which take the weights' too."""


def _gemms(step: Step, layer: AmaxLayer, forward_runs: int) -> list[AmaxGemm]:
    """The GEMMs of one layer that reduce any value. layer.weights: the weights one decomposed
    forward GEMM of the gathered input takes at once (gate and up; the input gradient is one
    GEMM a weight). On the tp ring the decomposed GEMMs' tensorwise scale of a gathered tensor
    (a column layer's input, a row layer's output gradient) is reduced from its chunks over tp
    (megatronish.layers.overlap)."""
    t, c = step.tp > 1, step.cp > 1
    tp, cp = ({"tp"} if t else set()), ({"cp"} if c else set())
    column, out, inner, weights, group = (
        layer.column,
        layer.out,
        layer.inner,
        layer.weights,
        layer.group,
    )
    runs, per_weight = group.runs, group.weights * t
    if step.cfg.train.fp8_recipe == "tensorwise":  # backward reuses the weight's scale
        gathered = (tp | cp, runs) if group.ring else (cp, runs * c)
        if column:
            rows = [
                AmaxGemm("forward", *gathered, tp, weights * per_weight, forward_runs, 1),
                AmaxGemm("input gradient", tp | cp, runs * (t or c), set(), 0, weights, 0),
            ]
        else:
            rows = [
                AmaxGemm("forward", tp | cp, runs * (t or c), tp, per_weight, forward_runs, 1),
                AmaxGemm("input gradient", *gathered, set(), 0, 1, 0),
            ]
    else:  # rowwise
        if column:  # the GEMM whose K (the layer's out or in) is split over tp
            dy, w = group.rows * t * group.parts, per_weight * inner * group.parts
            rows = [AmaxGemm("input gradient", tp, dy, tp, w, weights, weights)]
        else:
            rows = [AmaxGemm("forward", tp, group.rows * t, tp, per_weight * out, forward_runs, 1)]
        width = out // step.tp + inner if column else out + inner // step.tp
        if step.cfg.model.lora is None:  # LoRA's frozen weights get no gradient GEMM
            rows.append(AmaxGemm("weight gradient", cp, runs * width * c, set(), 0, weights, 0))
    return [row for row in rows if row.values or row.weight_values]


def _over(step: Step, what: str, axes: set[str], values: int, calls: int) -> Collective:
    """`calls` all-reduces of `values` fp32 amaxes a step over the group of `axes`."""
    group, size = {
        frozenset({"tp"}): ("tp", step.tp),
        frozenset({"cp"}): ("cp", step.cp),
        frozenset({"tp", "cp"}): ("tp_cp", step.tp * step.cp),
    }[frozenset(axes)]
    return Collective(what, "all_reduce", group, size, values * FP32_BYTES, calls, Purpose.FP8_AMAX)


def train_format(train: TrainConfig) -> Format:
    """The numeric format of the blocks' linear layers under train.precision, which states the
    bytes of its casts (megatronish.layers.formats)."""
    return numeric_format(RECIPES[train.fp8_recipe] if train.precision == "fp8" else None)
