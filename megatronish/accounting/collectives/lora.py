"""A LoRA run's tp collectives (model.lora; megatronish.layers.lora), from the base model's
(accounting.collectives.tp): the adapters' own, and the base's backward ones that do not run.

- A row-parallel target's adapter (o_proj, down_proj) sums A x [b, s, r] over tp: an
  all-reduce forward, or under sequence parallelism a reduce-scatter forward and an all-gather
  of its gradient backward, per micro-batch (the forward again under full recompute).
- The adapters' gradients summed over tp (accounting.lora.adapter_counts) replace the
  replicated parameters' (the norms are frozen).
- No frozen weight gets a gradient (layers.linear, layers.overlap, fp8.gemm: no weight-gradient
  GEMM), so under sequence parallelism no column layer gathers its input again in backward for
  one: not qkv, a lone MLP up or the LM head (a column layer with adapters gathers its input
  once and keeps it for them).
- Under full recompute the MLP down's forward reduction reruns where down_proj has an adapter
  (the adapter saves its tensors after the base's reduction).
- Nothing before the first adapter needs a gradient (the embedding is frozen): on the first
  stage the embedding's gradient all-gather (sequence parallel) and the first block's qkv input
  gradient do not run; nor, where that block's q, k and v have no adapter, the gather of the
  attention projection's output gradient; nor, where its attention has
  none, its MLP's first projection input gradient; nor, where its attention and MLP gate and up
  have none, the gather of its MLP down's output gradient.
- Under parallel.tp_comm_overlap with sequence parallelism a column layer with adapters
  gathers its input whole (its adapters take the gathered input) and reduce-scatters its
  gradient whole: qkv's where q, k or v has one, the MLP's first projections' where gate or up
  has; the other layers' collectives are decomposed as the base model's.
"""

from __future__ import annotations

from dataclasses import replace

from megatronish.accounting.collectives.step import (
    FP32_BYTES,
    Collective,
    Purpose,
    Split,
    Step,
)
from megatronish.accounting.components import attention_of, mlp
from megatronish.accounting.lora import QKV, adapter_counts, block_targets, frozen_inputs
from megatronish.accounting.parameters import stage_blocks

REPLICATED = "replicated-parameter gradients"


def lora_tp_collectives(step: Step, ops: list[Collective]) -> list[Collective]:
    """The base model's tp collectives `ops` of `step` as a model.lora run issues them (module
    doc); `ops` unchanged without model.lora."""
    if step.cfg.model.lora is None or step.tp == 1:
        return ops
    fewer, whole = _fewer_calls(step), _whole_gemms(step)
    kept = []
    for op in ops:
        if op.what.startswith(REPLICATED):
            continue
        pieces = {Split.RING: step.tp - 1, Split.CHUNKS: step.tp}.get(op.split, 1)
        op = replace(op, count=op.count - fewer.get(op.what, 0) * step.accum * pieces)
        if op.split is Split.RING and op.under in whole:  # gathered whole, not on the ring
            kind = "reduce_scatter" if "gradient" in op.what else "all_gather"
            op = replace(op, kind=kind, payload=op.payload * step.tp, count=op.count // pieces)
            op = replace(op, split=Split.WHOLE, under="")
        kept.append(op)
    return kept + _adapter_collectives(step)


def _whole_gemms(step: Step) -> set[str]:
    """The column layers with adapters, whose sequence-parallel gather and its gradient's
    reduce-scatter parallel.tp_comm_overlap leaves whole (layers.linear: the adapters take the
    gathered input): qkv where q, k or v has one, the MLP's first projections where gate or up
    has."""
    targets = {t for columns, _ in _stage_targets(step) for t in columns}
    adapted = {"qkv": bool(targets & set(QKV)), "up": bool(targets - set(QKV))}
    return {gemm for gemm, whole in adapted.items() if whole}


def _stage_targets(step: Step) -> list[tuple[dict, dict]]:
    return [
        block_targets(step.cfg, step.derived, i) for i in stage_blocks(step.derived, step.pp_rank)
    ]


def _fewer_calls(step: Step) -> dict[str, int]:
    """Calls per micro-batch, by the collective's name, that the base model's count has and a
    LoRA run does not make (negative: calls the LoRA run makes in addition)."""
    blocks = _stage_targets(step)
    fewer = {"MLP down output (forward)": 0}
    if step.sp:
        fewer |= _no_gather_again(step)
    full = step.cfg.train.activation_checkpointing == "full"
    if full and not (step.cfg.model.dropout > 0 or step.overlap):  # tp's down_runs 1
        # the down adapter saves tensors after the base's reduction: a recompute reruns it
        fewer["MLP down output (forward)"] = -sum("down_proj" in rows for _, rows in blocks)
    if step.first and blocks:
        for what, calls in _frozen_start(step).items():
            fewer[what] = fewer.get(what, 0) + calls
    return fewer


def _frozen_start(step: Step) -> dict[str, int]:
    """The first block's backward collectives that do not run (module doc)."""
    frozen = frozen_inputs(step.cfg, step.derived, step.pp_rank)
    fewer = {
        "qkv input gradient (backward)": int("qkv" in frozen),
        "MLP first projection input gradient (backward)": int("mlp_in" in frozen),
    }
    if step.sp:
        fewer["embedding output gradient (backward)"] = 1
        fewer["attention projection output gradient (backward)"] = int("proj" in frozen)
        fewer["MLP down output gradient (backward)"] = int("down" in frozen)
    return fewer


def _no_gather_again(step: Step) -> dict[str, int]:
    """The sequence-parallel gathers again in backward, for a weight gradient, that a LoRA run
    does not make (module doc): qkv's, a lone MLP up's and the LM head's."""
    model = step.cfg.model
    column, _ = attention_of(model).tp_inputs(model, step.b * step.s, step.operand_bytes)
    qkv = step.layers - step.linear_layers if column else 0
    lone_up = 0 if mlp.keeps_gathered(model) else step.layers - step.moe_layers
    heads = 1 + step.mtp if step.last else 0
    return {
        "qkv input (forward, backward)": qkv,
        "qkv input again (backward)": qkv,
        "MLP input (forward, backward)": lone_up,
        "MLP input again (backward)": lone_up,
        "LM head input (forward, backward)": heads,
    }


def _adapter_collectives(step: Step) -> list[Collective]:
    """The row adapters' reductions of A x and the adapters' gradients summed over tp."""
    adapters = sum(len(rows) for _, rows in _stage_targets(step))
    runs = 2 if step.cfg.train.activation_checkpointing == "full" else 1
    hidden = step.b * step.s * step.cfg.model.lora.rank * step.operand_bytes
    calls, what = adapters * step.accum, "LoRA row adapters' A x"
    rows = [("reduce_scatter", "(forward)", runs), ("all_gather", "gradient (backward)", 1)]
    if not step.sp:
        rows = [("all_reduce", "(forward)", runs)]
    ops = [
        Collective(f"{what} {when}", kind, "tp", step.tp, hidden, calls * n, Purpose.ACTIVATION)
        for kind, when, n in rows
    ]
    summed = adapter_counts(step.cfg, step.derived, step.pp_rank)[1] * FP32_BYTES
    grad = Purpose.GRADIENT_REDUCTION
    what = f"{REPLICATED} (LoRA adapters summed over tp)"
    return ops + [Collective(what, "all_reduce", "tp", step.tp, summed, 1 if summed else 0, grad)]
