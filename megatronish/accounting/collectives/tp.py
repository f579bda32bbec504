"""Tensor parallelism: what a rank issues over its tp group of t ranks (nothing at t = 1).

Per micro-batch without sequence parallelism: one fp32 all-reduce after the embedding (first
stage); per layer 2 all-reduces forward (attention projection, MLP down) and 2 backward (input
gradients of qkv and of the MLP's first projection), each c [b, s, h]; the LM head's input
gradient c [b, s, h] backward (last stage). With sequence parallelism each activation
all-reduce becomes an all-gather plus a reduce-scatter of the same full tensor: forward
all-gathers of the norm outputs before qkv, the MLP and the LM head, reduce-scatters of the
row-parallel outputs; backward the matching reduce-scatters of the input gradients and
all-gathers of the output gradients, the all-gather of the embedding's gradient, and a second
all-gather of the input of qkv, of a lone MLP up (gelu) and of the LM head (these recompute
their gathered input instead of keeping it; swiglu's gate and up keep it:
accounting.components.mlp.keeps_gathered; so do a linear-attention block's four input
projections, gathered once for qkv, z, b and a). Full activation
checkpointing reruns each block's forward, up to the last op that saves a tensor for backward
(torch.utils.checkpoint stops there): the attention projection's collective, and the MLP
down's only with dropout after it.

Multi-head latent attention (model.attention mla) has no qkv collective: its replicated
down-projections run on the layer input, and their outputs (the query latent, the normed kv
latent and the rotary key, c [b, s, q_lora_rank + kv_lora_rank + qk_rope_head_dim]) enter the
tp region together: their gradient all-reduced backward, or under sequence parallelism
all-gathered forward (again in a full-recompute rerun, not in backward: the up-projections keep
it) and reduce-scattered backward. Without q_lora_rank the query projection is
column-parallel from the layer input and keeps qkv's collectives.

The vocab-parallel cross entropy (last stage, per micro-batch): the fp32 row max [b, s] and
the target logit and sum of exp [2, b, s].

Multi-token prediction (model.mtp_depth D, last stage): its D blocks count as layers; per
micro-batch one fp32 all-reduce of the D embeddings ahead [b, D, s, h] forward (under sequence
parallelism also the all-gather of each one's fp32 gradient backward), and the LM head's and
the cross entropy's collectives once more per module.

Per micro-batch and MoE layer (T = b s tokens, k top_k, E experts): the combine weights' fp32
gradient [T, k] backward (the output and the routed tokens' gradient are the MLP's two
all-reduces above) and a shared expert's two; under sequence parallelism instead the weights
all-gathered [T, k] fp32 and their gradient reduce-scattered, the tokens' experts all-gathered
[T, k] int64, the E int64 counts all-reduced, a shared expert's gathers and reduce-scatters.

Per step: the grad-norm partial sum (one fp64) and, under sequence parallelism (and with
model.qk_norm, the query and key norms at any tp), the sum of the replicated parameters'
gradients (fp32, ``tp_summed_grad_count``).

With parallel.tp_comm_overlap (megatronish.layers.overlap) the linear layers' collectives are
decomposed (``decomposed``): under sequence parallelism each all-gather and reduce-scatter of
qkv, the MLP (a shared expert's too), the attention projection and the LM head becomes t - 1
ring hops ("tp_ring") of one sequence chunk, payload / t each, the same bytes sent; without
it the attention projection's and the MLP down's forward all-reduce (a shared expert's too)
become t all-reduces of a chunk, payload / t each (a linear-attention block's run under its own
GEMMs: its input's under its four input projections together, "linear_in", its out_proj's
under "linear_out"). The embedding's, the loss's, the routing's
and the backward all-reduces stay whole. The decomposed row-parallel layer saves its tensors
for backward only after its reduction, so full recompute reruns the MLP down's with or
without dropout. Under train.precision fp8 (megatronish.layers.fp8_format) the forward
all-gathers of qkv's and the MLP's input carry its fp8 cast (a byte a value and each token's
float32 scales: its wire_bytes); backward gathers again the tensorwise cast's payload (a
byte a value) or, rowwise and blockwise, the input in its own precision. Gate and up
keep what they gathered: the fp8 cast (tensorwise), or, rowwise and blockwise, the input
itself, gathered forward in its own precision.
"""

from __future__ import annotations

from typing import NamedTuple

from megatronish.accounting.collectives.fp8 import train_format
from megatronish.accounting.collectives.step import (
    FP32_BYTES,
    FP64_BYTES,
    INT64_BYTES,
    Collective,
    Kind,
    Purpose,
    Split,
    Step,
    moe_count_bytes,
)
from megatronish.accounting.components import attention_of, mlp
from megatronish.accounting.components import moe as moe_cost
from megatronish.accounting.parameters import tp_summed_grad_count

LINEAR = "linear attention"  # how a linear-attention (Gated DeltaNet) block's rows are named


class Row(NamedTuple):
    """A tp collective before ``_over_tp`` counts it over the step's micro-batches."""

    what: str
    kind: Kind
    payload: int
    per_micro: int
    """Calls per micro-batch."""
    under: str = ""
    """The GEMM parallel.tp_comm_overlap would decompose it under (``decomposed``)."""
    purpose: Purpose = Purpose.ACTIVATION
    split: Split = Split.WHOLE


def _activation_bytes(step: Step) -> int:
    """Bytes of a matmul operand's [b, s, h] activation, c [b, s, h]."""
    return step.b * step.s * step.h * step.operand_bytes


def tp_collectives(step: Step) -> list[Collective]:
    """The tp collectives of one step (see module doc)."""
    embed = 1 if step.first else 0  # the embedding's collectives, per micro-batch
    fp32 = step.b * step.s * step.h * FP32_BYTES
    ops = _over_tp(
        step,
        [
            Row("embedding output (forward)", "all_reduce", fp32, embed),
            Row("multi-token prediction embeddings (forward)", "all_reduce", fp32 * step.mtp, 1),
        ],
    )
    ops += _sequence_parallel_blocks(step) if step.sp else _blocks(step)
    ops += _vocab_parallel_loss(step) + _moe(step)
    what, norm = "gradient norm (fp64 partial sum)", Purpose.GRADIENT_NORM
    ops.append(Collective(what, "all_reduce", "tp", step.tp, FP64_BYTES, 1, norm))
    replicated = tp_summed_grad_count(step.cfg, step.derived, step.pp_rank) * FP32_BYTES
    if replicated:
        what = "replicated-parameter gradients (sequence parallel, query and key norms)"
        grad = Purpose.GRADIENT_REDUCTION
        ops.append(Collective(what, "all_reduce", "tp", step.tp, replicated, 1, grad))
    return ops


def _over_tp(step: Step, rows: list[Row]) -> list[Collective]:
    """The Collectives of rows over tp: each row's calls in every one of the step's
    micro-batches."""
    return [
        Collective(
            row.what,
            row.kind,
            "tp",
            step.tp,
            row.payload,
            row.per_micro * step.accum,
            row.purpose,
            row.under,
            row.split,
        )
        for row in rows
    ]


def _forward_runs(step: Step, decomposed: bool) -> tuple[int, int]:
    """Forward runs a step makes of the attention projection's and the MLP down's collective:
    full recompute reruns the first, and the second only with dropout after it, or when it is
    decomposed (module doc)."""
    full = step.cfg.train.activation_checkpointing == "full"
    down_rerun = full and (step.cfg.model.dropout > 0 or decomposed)
    return (2 if full else 1), (2 if down_rerun else 1)


def _moe_runs(step: Step) -> int:
    """Forward runs a step makes of an MoE layer's collectives (its routing, the experts, the
    shared expert and its output's reduction): full recompute reruns them all."""
    return 2 if step.cfg.train.activation_checkpointing == "full" else 1


def _attention_inputs(step: Step) -> tuple[int, int]:
    """(layers whose attention takes the layer input through a column-parallel projection: qkv,
    or mla's queries without q_lora_rank; bytes of what else enters the tp region per
    micro-batch and layer: mla's latents, 0 without)."""
    model = step.cfg.model
    column, entering = attention_of(model).tp_inputs(model, step.b * step.s, step.operand_bytes)
    return (step.layers if column else 0), entering


def _blocks(step: Step) -> list[Collective]:
    """Without sequence parallelism: the layers' and the LM head's all-reduces (an MoE layer's
    output all-reduce stays whole under parallel.tp_comm_overlap)."""
    act, n, head = _activation_bytes(step), step.layers, _heads(step)
    moe, (attn_runs, down_runs) = step.moe_layers, _forward_runs(step, step.overlap)
    qkv, latents = _attention_inputs(step)
    forward = [
        *_projection_outputs(step, "all_reduce", attn_runs),
        Row("MLP down output (forward)", "all_reduce", act, (n - moe) * down_runs, "down"),
    ]
    return _over_tp(
        step,
        decomposed(step, forward)
        + [
            Row("MoE output (forward)", "all_reduce", act, moe * _moe_runs(step)),
            Row("qkv input gradient (backward)", "all_reduce", act, qkv),
            Row("MLA latents gradient (backward)", "all_reduce", latents, n if latents else 0),
            Row("MLP first projection input gradient (backward)", "all_reduce", act, n),
            Row("LM head input gradient (backward)", "all_reduce", act, head),
        ],
    )


def _sequence_parallel_blocks(step: Step) -> list[Collective]:
    """Under sequence parallelism: the layers', the LM head's and the embedding gradient's
    all-gathers and reduce-scatters (an MoE layer's, of its tokens and its output, stay whole
    under parallel.tp_comm_overlap)."""
    act, n, moe = _activation_bytes(step), step.layers, step.moe_layers
    dense = n - moe
    embed, head = (1 if step.first else 0), _heads(step)
    fp32 = step.b * step.s * step.h * FP32_BYTES
    attn_runs, down_runs = _forward_runs(step, step.overlap)
    rerun = 1 if step.cfg.train.activation_checkpointing == "full" else 0
    moe_runs = _moe_runs(step)
    ag, rs = "all_gather", "reduce_scatter"
    qkv, latents = _attention_inputs(step)
    mla, linear = (n if latents else 0), step.linear_layers
    return _over_tp(
        step,
        [
            Row("embedding output gradient (backward)", ag, fp32, embed),
            Row("MLA latents (forward)", ag, latents, mla * (1 + rerun)),
            Row("MLA latents gradient (backward)", rs, latents, mla),
            Row("multi-token prediction embedding gradients (backward)", ag, fp32, step.mtp),
            Row("MoE tokens (forward, backward)", ag, act, moe * (1 + rerun)),
            Row("MoE tokens gradient (backward)", rs, act, moe),
            Row("MoE output (forward)", rs, act, moe * moe_runs),
            Row("MoE output gradient (backward)", ag, act, moe),
        ]
        + decomposed(
            step,
            [
                *_gathered_inputs(step, qkv, rerun),
                Row("LM head input (forward, backward)", ag, act, 2 * head, "head"),
                Row("qkv input gradient (backward)", rs, act, qkv - linear, "qkv"),
                Row(f"{LINEAR} input gradient (backward)", rs, act, linear, "linear_in"),
                Row("MLP first projection input gradient (backward)", rs, act, dense, "up"),
                Row("LM head input gradient (backward)", rs, act, head, "head"),
                *_projection_outputs(step, rs, attn_runs),
                Row("MLP down output (forward)", rs, act, dense * down_runs, "down"),
                Row("attention projection output gradient (backward)", ag, act, n - linear,
                    "proj_backward"),
                Row(f"{LINEAR} out_proj output gradient (backward)", ag, act, linear,
                    "linear_out_backward"),
                Row("MLP down output gradient (backward)", ag, act, dense, "down_backward"),
            ],
        ),
    )  # fmt: skip


def _gathered_inputs(step: Step, qkv: int, rerun: int) -> list[Row]:
    """The sequence-parallel all-gathers of qkv's and the dense MLP's input (rows for
    ``decomposed``): forward, and once more under full recompute; qkv and a lone MLP up gather
    again in backward (gate and up keep it, as do a linear-attention block's four projections).
    Decomposed under fp8 (module doc) the forward ones carry the input's fp8 cast, and backward
    gathers the tensorwise cast's payload (kept by gate and up) or the input itself (also for
    gate and up)."""
    act, keep = _activation_bytes(step), mlp.keeps_gathered(step.cfg.model)
    dense, linear = step.layers - step.moe_layers, step.linear_layers
    full = qkv - linear  # linear attention: one gather for four projections, kept
    if not (step.overlap and step.cfg.train.precision == "fp8"):
        return [
            Row("qkv input (forward, backward)", "all_gather", act, full * (2 + rerun), "qkv"),
            Row(f"{LINEAR} input (forward)", "all_gather", act, linear * (1 + rerun), "linear_in"),
            *mlp_input_gathers(step, "MLP input", dense, 1 + rerun, "up", keep),
        ]
    fmt = train_format(step.cfg.train)
    cast = fmt.wire_bytes(step.b * step.s, step.h, step.operand_bytes, False)
    return [
        Row("qkv input, fp8 cast (forward)", "all_gather", cast, full * (1 + rerun), "qkv"),
        Row(f"{LINEAR} input, fp8 cast (forward)", "all_gather", cast, linear * (1 + rerun),
            "linear_in"),
        Row("qkv input again (backward)", "all_gather", _gathered_again_bytes(step), full, "qkv"),
        *mlp_input_gathers(step, "MLP input", dense, 1 + rerun, "up", keep),
    ]  # fmt: skip


def _projection_outputs(step: Step, kind: Kind, runs: int) -> list[Row]:
    """The row-parallel attention projections' forward reductions (rows for ``decomposed``),
    each run `runs` times: the full-attention blocks' under proj, the linear-attention blocks'
    under their out_proj."""
    act, linear = _activation_bytes(step), step.linear_layers
    return [
        Row("attention projection output (forward)", kind, act, (step.layers - linear) * runs,
            "proj"),
        Row(f"{LINEAR} out_proj output (forward)", kind, act, linear * runs, "linear_out"),
    ]  # fmt: skip


def _gathered_again_bytes(step: Step) -> int:
    """Bytes of an input gathered again in backward under fp8 on the ring: the tensorwise
    cast's payload (a byte a value), or, rowwise and blockwise, the input itself."""
    return train_format(step.cfg.train).again_bytes(step.b * step.s, step.h, step.operand_bytes)


def mlp_input_gathers(
    step: Step, what: str, mlps: int, runs: int, gemm: str, keep: bool
) -> list[Row]:
    """The sequence-parallel all-gathers of the input of `mlps` MLPs (a dense MLP's or a shared
    expert's; rows for ``decomposed``), each run forward `runs` times: a lone up gathers again in
    backward, gate and up keep what they gathered (`keep`: accounting.components.mlp
    keeps_gathered). Decomposed under fp8 the forward ones carry the input's fp8 cast, except
    kept ones rowwise and blockwise (the input itself, kept for backward's per-feature scales);
    the lone up's again is ``_gathered_again_bytes``."""
    act, again_runs = _activation_bytes(step), int(not keep)
    if not (step.overlap and step.cfg.train.precision == "fp8"):
        rows = mlps * (runs + again_runs)
        return [Row(f"{what} (forward, backward)", "all_gather", act, rows, gemm)]
    fmt = train_format(step.cfg.train)
    cast = fmt.wire_bytes(step.b * step.s, step.h, step.operand_bytes, False)
    mlp_cast = fmt.ring_carries_cast(keep_gathered=keep)
    again = _gathered_again_bytes(step)
    return [
        Row(f"{what}, fp8 cast (forward)", "all_gather", cast, mlps * runs * mlp_cast, gemm),
        Row(f"{what} (forward)", "all_gather", act, mlps * runs * (not mlp_cast), gemm),
        Row(f"{what} again (backward)", "all_gather", again, mlps * again_runs, gemm),
    ]


def decomposed(step: Step, rows: list[Row]) -> list[Row]:
    """rows of collectives the linear layers decompose, as parallel.tp_comm_overlap issues them
    (module doc): an all-gather or reduce-scatter as t - 1 ring hops of payload / t, an
    all-reduce as t of payload / t; without it as they are, whole (under no GEMM)."""
    if not step.overlap:
        return [row._replace(under="") for row in rows]
    t = step.tp
    return [
        row._replace(payload=row.payload // t, per_micro=row.per_micro * t, split=Split.CHUNKS)
        if row.kind == "all_reduce"
        else row._replace(
            kind="tp_ring",
            payload=row.payload // t,
            per_micro=row.per_micro * (t - 1),
            split=Split.RING,
        )
        for row in rows
    ]


def _heads(step: Step) -> int:
    """Calls of the output layer per micro-batch: the main model's and each multi-token
    prediction module's on the last stage, none on the others."""
    return 1 + step.mtp if step.last else 0


def _vocab_parallel_loss(step: Step) -> list[Collective]:
    """The last stage's cross entropies over the vocabulary's tp shards (the main one and each
    multi-token prediction module's), per micro-batch."""
    loss = _heads(step)
    rows, stat = step.b * step.s * FP32_BYTES, Purpose.LOSS
    return _over_tp(
        step,
        [
            Row("cross-entropy row max (forward)", "all_reduce", rows, loss, purpose=stat),
            Row(
                "cross-entropy target logit and sum of exp (forward)",
                "all_reduce",
                2 * rows,
                loss,
                purpose=stat,
            ),
        ],
    )


def _moe(step: Step) -> list[Collective]:
    """The stage's MoE layers' routing and shared-expert collectives over tp."""
    moe, n = step.cfg.model.moe, step.moe_layers
    if not n:
        return []
    tokens = step.b * step.s * moe.top_k  # T k routed rows
    weights, act = tokens * FP32_BYTES, _activation_bytes(step)
    counts, runs = moe_count_bytes(step), _moe_runs(step)
    indices, route = tokens * INT64_BYTES, Purpose.ROUTING
    if not step.sp:
        what = "MoE combine weights gradient (backward)"
        rows = [Row(what, "all_reduce", weights, n, purpose=route)]
        if step.derived.shared_d_ff:
            shared = [
                Row("shared expert output (forward)", "all_reduce", act, n * runs, "shared_down")
            ]
            rows += decomposed(step, shared)
            rows += [Row("shared expert input gradient (backward)", "all_reduce", act, n)]
        return _over_tp(step, rows)
    # Each tp rank routes its own tokens: weights and experts are gathered.
    rows = [
        Row("MoE combine weights (forward)", "all_gather", weights, n * runs, purpose=route),
        Row("MoE combine weights gradient (backward)", "reduce_scatter", weights, n, purpose=route),
        Row("MoE experts of the tokens (forward)", "all_gather", indices, n * runs, purpose=route),
        Row(
            "MoE routed counts for the balancing loss",
            "all_reduce",
            counts,
            n * runs,
            purpose=route,
        ),
    ]
    if step.derived.shared_d_ff:
        ag, rs, shared_keep = "all_gather", "reduce_scatter", moe_cost.SHARED_KEEPS_GATHERED
        shared = [
            *mlp_input_gathers(step, "shared expert input", n, runs, "shared_up", shared_keep),
            Row("shared expert output gradient (backward)", ag, act, n, "shared_down_backward"),
            Row("shared expert output (forward)", rs, act, n * runs, "shared_down"),
            Row("shared expert input gradient (backward)", rs, act, n, "shared_up"),
        ]
        rows += decomposed(step, shared)
    return _over_tp(step, rows)
