"""Predicted time of one optimizer step of a layout (``step_time``), with its breakdown and the
throughput it gives (tokens/s, model and hardware TFLOP/s per GPU, MFU and HFU). Pure
functions of the config, its derived layout, a Device and the Efficiency constants.

Per pipeline stage r and micro-batch: the compute of its layers (accounting.layer_time: forward,
backward, and the forward again under full recompute or the attention core under selective),
the embedding on the first stage and the output layer on the last, with on the last its
multi-token prediction modules (model.mtp_depth: each a layer, its eh_proj and norms and the
output layer again); plus the collectives that
stage issues (accounting.collectives, the count the tests hold the wire to), timed by
accounting.comm_time and split by what hides them:

- tp (and the tp part of MoE routing): on the critical path, all exposed. Sequence
  parallelism changes their bytes and kinds (all-gather + reduce-scatter), not their exposure.
  With parallel.tp_comm_overlap the linears' collectives run in pieces under their GEMMs'
  sequence chunks: exposed is only what a piece takes beyond its chunk's GEMM, and an
  all-reduce's last chunk (accounting.tp_overlap); the rest is hidden (``tp_hidden_s``).
- ep all-to-all (MoE dispatch and return): on the critical path, exposed.
- cp ring (k, v and their gradients): each hop runs under the attention of one block, so only
  what exceeds the layer's attention time is exposed.
- dp gradient reduction (all-reduce, or ZeRO reduce-scatter and, of Muon's matrices, the
  reduce to their owners: (n-1)/n of its payload, as a broadcast): with
  optim.overlap_grad_reduce it runs under the stage's last backward: exposed is what exceeds
  that backward, and at least the last bucket (optim.bucket_mb); without overlap, all of it.
  ZeRO-2 and 3 reduce-scatter after every micro-batch: under the m backwards, at least the
  last bucket of each. The ZeRO-1 and 2 parameter all-gather likewise runs under the next
  step's first forward; ZeRO-3's gathers (with optim.zero3_prefetch) under the m forwards and
  backwards (at pp > 1 once, under the first forward), at least the first bucket of each
  pass. The other dp and embedding collectives (loss, norms, tied embedding, flags) are
  exposed.
- pp: the point-to-point sends of activations and gradients are exposed (blocking in the
  schedule); the pipeline bubble is (pp - 1) / (v m) of the m micro-batches' time of the
  slowest stage, i.e. (pp - 1) / v of its time for one micro-batch.
- optimizer: AdamW streams the fp32 parameters, gradients and moments of the state it holds
  (28 bytes a parameter: read 16, write 12; ZeRO: its 1 / (dp cp) share) and the gradient
  norm reads every local gradient (4 bytes), at the memory bandwidth; under optim.name muon
  (an overestimate of AdamW's share, which Muon's matrices leave) each Muon matrix's
  Newton-Schulz GEMMs in bf16 (accounting.muon), its tp all-gathers exposed with tp's.

Step time = m x (stage compute + exposed tp + cp + ep per micro-batch) of the slowest stage
+ bubble + sends + exposed dp + optimizer.

FLOPs: model FLOPs are accounting.flops' (3 passes, no recompute); hardware FLOPs add what
recompute reruns: the layers' forward (full; Narayanan et al. 2021, eq. 3: the multi-token
prediction blocks too, not the output layer nor the modules' eh_proj) or the attention
core's forward, 2 s^2 a (d + d_v) per sequence and layer (selective; s min(s, W) in a layer with a
sliding window W).

A stage's layers are timed by kind: dense or MoE, and the sliding window each attends through
(model.sliding_window after the first model.full_attention_layers, by global layer index).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from megatronish.accounting.cluster import Cluster, default_cluster
from megatronish.accounting.collectives import Purpose, collectives_per_step
from megatronish.accounting.collectives.step import FP32_BYTES, GRAD_REDUCE_BYTES
from megatronish.accounting.comm_time import Mesh, collective_seconds
from megatronish.accounting.components.moe import local_parameters
from megatronish.accounting.flops import (
    attention_flops_per_token,
    forward_flops_per_step,
    model_flops_per_step,
)
from megatronish.accounting.hardware import Device
from megatronish.accounting.layer_time import (
    embedding_time,
    layer_time,
    linear_gemms,
    mtp_projection_time,
    output_time,
)
from megatronish.accounting.muon import newton_schulz_seconds
from megatronish.accounting.parameters import (
    local_parameter_count,
    stage_moe_layers,
)
from megatronish.accounting.roofline import GPU_EFFICIENCY, Efficiency, memory_seconds
from megatronish.accounting.tp_overlap import split_seconds
from megatronish.config import Config, Derived, attention_window

PARTS = (
    "compute",
    "exposed_tp",
    "exposed_cp",
    "exposed_ep",
    "exposed_dp",
    "pipeline_bubble",
    "pipeline_sends",
    "optimizer",
)


@dataclass
class StepTime:
    """One layout's predicted step. breakdown: seconds per part (PARTS), summing to
    step_time_s; tp_hidden_s: the tp communication the decomposition hides under the GEMMs
    (parallel.tp_comm_overlap), beside the exposed_tp part."""

    step_time_s: float
    tokens_per_step: int
    world_size: int
    model_flops: float
    hardware_flops: float
    peak_flops: float
    breakdown: dict[str, float] = field(default_factory=dict)
    tp_hidden_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time_s / self.world_size / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.step_time_s / self.world_size / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def hfu(self) -> float:
        return self.hardware_tflops_per_gpu * 1e12 / self.peak_flops


def flops_per_step(cfg: Config, derived: Derived) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step (see module doc)."""
    train, model = cfg.train, cfg.model
    plain = dataclasses.replace(
        cfg, train=dataclasses.replace(train, activation_checkpointing="none")
    )
    model_flops = model_flops_per_step(plain, derived)
    attention = attention_flops_per_token(cfg, derived) * derived.tokens_per_step
    if train.activation_checkpointing == "full":
        # The layers' forward again (the multi-token prediction blocks among them), not the
        # output layer, nor the modules' eh_proj and their output layer.
        h, depth = model.d_model, model.mtp_depth
        head = (1 + depth) * 2 * h * derived.vocab_size + depth * 2 * 2 * h * h
        forward = forward_flops_per_step(plain, derived)
        return model_flops, model_flops + (forward - head * derived.tokens_per_step)
    if train.activation_checkpointing == "selective":
        return model_flops, model_flops + attention
    return model_flops, model_flops


class LayerKind(NamedTuple):
    """What sets a layer's time apart: an MoE MLP, its sliding window (None: none) and its
    attention kind (ModelConfig.block_attention)."""

    moe: bool
    window: int | None
    mixer: str


def _kinds(
    cfg: Config, derived: Derived, layers: Iterable[int]
) -> tuple[tuple[LayerKind, int], ...]:
    """(LayerKind, how many) of `layers` (global indices), in a fixed order."""
    kinds = Counter(
        LayerKind(
            layer in derived.moe_layers,
            attention_window(cfg.model, layer),
            cfg.model.block_attention(layer),
        )
        for layer in layers
    )
    return tuple(
        sorted(kinds.items(), key=lambda item: (item[0].moe, item[0].window or 0, item[0].mixer))
    )


def _stage_kinds(cfg: Config, derived: Derived, r: int) -> tuple[tuple[LayerKind, int], ...]:
    """The kinds of stage r's layers."""
    return _kinds(cfg, derived, (layer for chunk in derived.stage_chunks(r) for layer in chunk))


def _mtp_kinds(cfg: Config, derived: Derived) -> tuple[tuple[LayerKind, int], ...]:
    """The kinds of the multi-token prediction modules' blocks (global indices n_layer ..
    n_layer + mtp_depth - 1)."""
    n_layer = cfg.model.n_layer
    return _kinds(cfg, derived, range(n_layer, n_layer + cfg.model.mtp_depth))


class StageSeconds(NamedTuple):
    """Seconds of one micro-batch on a stage."""

    compute: float
    forward: float
    backward: float
    attention_forward: float
    """The attention core's forward."""


def _stage(
    cfg: Config, derived: Derived, r: int, device: Device, eff: Efficiency, attention: str
) -> StageSeconds:
    """The seconds of stage r; the last stage's include its multi-token prediction modules:
    each a layer (rerun by full recompute), its eh_proj and norms, and the output layer again
    (not rerun)."""
    recompute, last = cfg.train.activation_checkpointing, r == derived.pp - 1
    kinds = _stage_kinds(cfg, derived, r) + (_mtp_kinds(cfg, derived) if last else ())
    parts = [
        (layer_time(cfg, derived, device, eff, kind.moe, attention, kind.window, kind.mixer), n)
        for kind, n in kinds
    ]
    compute = sum(lt.total(recompute) * n for lt, n in parts)
    forward = sum(lt.forward * n for lt, n in parts)
    backward = sum((lt.total(recompute) - lt.forward) * n for lt, n in parts)
    attention_forward = sum(lt.attention_forward * n for lt, n in parts)
    depth = cfg.model.mtp_depth if last else 0
    edges = ((embedding_time, int(r == 0)), (output_time, int(last) * (1 + depth)))
    for edge, n in (*edges, (mtp_projection_time, depth)):
        if n:
            lt = edge(cfg, derived, device, eff)
            compute += (lt.forward + lt.backward) * n
            forward += lt.forward * n
            backward += lt.backward * n
    return StageSeconds(compute, forward, backward, attention_forward)


class StageStep(NamedTuple):
    """One stage's share of the step: a micro-batch's compute and its exposed tp, cp and ep
    communication, its compute alone, its exposed communication per part (``_comm``) and its
    optimizer step, in seconds."""

    per_micro: float
    compute: float
    comm: dict[str, float]
    optimizer: float


def _optimizer_seconds(
    cfg: Config, derived: Derived, r: int, device: Device, eff: Efficiency
) -> float:
    params = local_parameter_count(cfg, derived, r)
    experts = stage_moe_layers(derived, r) * local_parameters(cfg, derived, experts_only=True)
    if cfg.optim.zero >= 1:
        state = (params - experts) / (derived.dp * derived.cp) + experts / max(
            1, derived.dp * derived.cp // derived.ep
        )
    else:
        state = params
    adamw = memory_seconds(28 * state + 4 * params, device.hbm_tb_s * 1e12, eff, kernels=4)
    return adamw + newton_schulz_seconds(cfg, derived, r, device, eff)


def _comm(
    cfg, derived, r, mesh, device, cluster, eff, attention_s, forward_s: float, backward_s: float
):
    """Exposed seconds per part of stage r's collectives in one step (see module doc)."""
    out = dict.fromkeys(("tp", "tp_hidden", "cp", "ep", "dp", "sends", "pp"), 0.0)
    gemms = linear_gemms(cfg, derived, device, eff)
    grad, gather, ring = 0.0, 0.0, 0.0
    grad_width = GRAD_REDUCE_BYTES[cfg.optim.grad_reduce_dtype]
    bucket = cfg.optim.bucket_mb * 1e6
    grad_payload = gather_payload = 0.0
    for op in collectives_per_step(cfg, derived, r):
        seconds = collective_seconds(op, mesh, cluster, eff)
        if op.group == "tp" and op.under:
            exposed, hidden = split_seconds(op, seconds, gemms[op.under], derived.tp)
            out["tp"] += exposed
            out["tp_hidden"] += hidden
        elif op.group == "tp":
            out["tp"] += seconds
        elif op.kind == "cp_ring":
            ring += seconds
        elif op.group == "cp":
            out["cp"] += seconds
        elif op.kind == "all_to_all":
            out["ep"] += seconds
        elif op.kind == "p2p":
            out["sends"] += seconds
        elif op.group == "pp":
            out["pp"] += seconds
        elif op.group in ("dp", "ep") and op.kind == "all_gather":
            gather += seconds
            gather_payload += op.payload * op.count
        elif op.purpose is Purpose.GRADIENT_REDUCTION and op.group == "dp" and op.payload > 64:
            grad += seconds
            grad_payload += op.payload * FP32_BYTES / grad_width
        else:
            out["dp"] += seconds
    out["cp"] += max(0.0, ring - attention_s)
    optim, m = cfg.optim, derived.grad_accum_steps
    if not (optim.overlap_grad_reduce and grad_payload):
        out["dp"] += grad + gather
        return out
    passes = m if optim.zero >= 2 else 1  # reductions after each micro-batch's backward
    last_bucket = grad * min(1.0, bucket * passes / grad_payload)
    out["dp"] += max(last_bucket, grad - passes * backward_s)
    if optim.zero < 3:
        out["dp"] += max(0.0, gather - forward_s)
    elif not optim.zero3_prefetch:
        out["dp"] += gather
    else:
        passes, under = (1, forward_s) if derived.pp > 1 else (2 * m, m * (forward_s + backward_s))
        first_bucket = gather * min(1.0, bucket * passes / gather_payload)
        out["dp"] += max(first_bucket, gather - under)
    return out


def step_time(
    cfg: Config,
    derived: Derived,
    device: Device,
    eff: Efficiency = GPU_EFFICIENCY,
    attention: str = "flash",
    cluster: Cluster | None = None,
) -> StepTime:
    """The predicted step of cfg (its parallel section a layout whose Derived is `derived`) on
    derived.world_size devices in `cluster` (None: the device's default, accounting.cluster);
    attention "flash" (megatronish's fused kernel) or "materialized" (scores in memory, as
    Megatron-LM ran before flash attention)."""
    cluster = cluster or default_cluster(device)
    m, pp, virtual = derived.grad_accum_steps, derived.pp, derived.pp_virtual
    mesh = Mesh(tp=derived.tp, cp=derived.cp, dp=derived.dp, pp=pp)
    recompute = cfg.train.activation_checkpointing
    passes = 3.5 + (1 if recompute != "none" else 0)  # attention forward, backward, recompute
    stages, done = [], {}
    for r in range(pp):
        # Stages that differ neither in their layers nor in being first or last time alike.
        key = (r == 0, r == pp - 1, _stage_kinds(cfg, derived, r))
        if key not in done:
            sec = _stage(cfg, derived, r, device, eff, attention)
            attention_s = sec.attention_forward * passes * m
            comm = _comm(
                cfg, derived, r, mesh, device, cluster, eff, attention_s, sec.forward, sec.backward
            )
            per_micro = sec.compute + (comm["tp"] + comm["cp"] + comm["ep"]) / m
            optimizer = _optimizer_seconds(cfg, derived, r, device, eff)
            done[key] = StageStep(per_micro, sec.compute, comm, optimizer)
        stages.append(done[key])
    slowest = max(stages, key=lambda st: st.per_micro)
    per_micro, compute, comm = slowest.per_micro, slowest.compute, slowest.comm
    breakdown = {
        "compute": m * compute,
        "exposed_tp": comm["tp"],
        "exposed_cp": comm["cp"],
        "exposed_ep": comm["ep"],
        "exposed_dp": max(st.comm["dp"] for st in stages),
        "pipeline_bubble": (pp - 1) / virtual * per_micro,
        "pipeline_sends": max(st.comm["sends"] + st.comm["pp"] for st in stages),
        "optimizer": max(st.optimizer for st in stages),
    }
    model_flops, hardware_flops = flops_per_step(cfg, derived)
    return StepTime(
        step_time_s=sum(breakdown.values()),
        tokens_per_step=derived.tokens_per_step,
        world_size=derived.world_size,
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        peak_flops=device.peak_flops,
        breakdown=breakdown,
        tp_hidden_s=comm["tp_hidden"],
    )
