"""`megatronish plan`: per-rank memory and predicted step time of a config at each layout, and
the fastest layout that fits, computed from formulas without starting anything.

The formulas are megatronish.accounting's: memory per rank (accounting.memory), the step-time
model (accounting.step_time, on accounting.layer_time, comm_time and roofline), communication
(accounting.collectives), FLOPs (accounting.flops), the GPUs (accounting.hardware). This module
searches the layouts (``search``) or takes one (``--layout``) and hands the rows to
commands.plan_report, which prints them. With --device cpu the device is this host, measured by
commands.calibrate.

The search: tensor-parallel degrees up to 8 (one node's fast links) dividing the heads, kv
heads and d_ff; cp up to 8 where every rank keeps at least MIN_CP_TOKENS tokens of a sequence;
pipeline degrees up to 64 with a layer for every stage; ep dividing dp and the experts;
micro-batch sizes 1, 2, 4, 8 (and the config's) that divide the global batch over dp;
interleaving v of 1, 2, 3, 4 where each stage's layers split evenly into v chunks and the
micro-batches are a multiple of pp; recompute none, selective, full. Sequence parallelism is on
at tp > 1 (without experts) and ZeRO always (the config's optim.zero, 1 at least; under optim.name
muon, which does not take ZeRO 1 to 3 yet, 0); a layout
fits when its fullest stage stays under HEADROOM of the device memory.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import NamedTuple

from megatronish.accounting.cluster import Cluster, cluster_gpu, cluster_named
from megatronish.accounting.comm_time import ring_ratio
from megatronish.accounting.hardware import Device, device_named
from megatronish.accounting.memo import remembering
from megatronish.accounting.memory import Estimate, estimate, layout_config
from megatronish.accounting.roofline import GPU_EFFICIENCY, Efficiency
from megatronish.accounting.step_time import StepTime, step_time
from megatronish.commands import plan_report
from megatronish.commands.check import data_vocab_size
from megatronish.commands.dpo_pass import reference_pass_lines
from megatronish.commands.plan_explain import explanation
from megatronish.config import Config, derive, world_size_of
from megatronish.errors import UserError

MIN_CP_TOKENS = 1024
HEADROOM = 0.90  # plan to use at most 90% of the device memory (allocator, NCCL, kernels)
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL = (1, 2, 3, 4)
RECOMPUTE = ("none", "selective", "full")
LAYOUT_KEYS = ("tp", "pp", "v", "cp", "dp", "ep")


@dataclass
class Row:
    """One layout: its config, memory (Estimate, GiB), where it fits its predicted step, and
    its cp ring's transfer over block compute time (``comm_time.ring_ratio``; None at cp 1)."""

    cfg: Config
    memory: Estimate
    time: StepTime | None
    ring_ratio: float | None


@dataclass
class Target:
    """What plan plans for: the device (a function of the layout on a CPU, where threads and
    links depend on it), its memory in GiB and a title."""

    name: str
    memory_gib: float
    peak_flops: float
    devices: object  # (tp, cp, dp) -> (Device, Efficiency)
    title: str
    cluster: Cluster | None = None
    """The cluster the GPUs sit in (None: the device's own node, accounting.cluster)."""

    def device(self, tp: int, cp: int, dp: int) -> tuple[Device, Efficiency]:
        return self.devices(tp, cp, dp)


def expert_degrees(cfg: Config, dp: int) -> list[int]:
    """The ep degrees plan tries at data-parallel degree dp: those dividing dp and the expert
    count (1 without experts)."""
    experts = cfg.model.moe.num_experts
    if experts == 0:
        return [1]
    return [ep for ep in range(1, dp + 1) if dp % ep == 0 and experts % ep == 0]


def target(
    gpu: str | None,
    memory_gb: float | None,
    device: str,
    calibration: str | None,
    world: int,
    cluster: str | None = None,
) -> Target:
    """The device plan plans for: a GPU by name or YAML file (None: the GPU a preset cluster
    holds, else H100) in a cluster by name or YAML file (None: the GPU's own nodes), or
    (device cpu) this host."""
    if memory_gb is not None and memory_gb <= 0:
        raise UserError(f"--gpu-memory {memory_gb}: must be > 0 (GiB)")
    if device == "cpu":
        from megatronish.commands.calibrate import cpu_device, load_or_measure

        measured = load_or_measure(calibration)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory = memory_gb or ram / world
        first, _ = cpu_device(measured, world, world)
        return Target(
            "cpu",
            memory,
            first.peak_flops,
            lambda tp, cp, dp: cpu_device(measured, world, tp * cp * dp),
            f"plan for {world} CPU process(es) on this host ({memory:.1f} GiB each; measured: "
            f"{first.peak_tflops * 1e3:.1f} GFLOP/s fp32 matmul a rank, "
            f"{first.hbm_tb_s * 1e3:.1f} GB/s memory, shared-memory all-reduce "
            f"{first.nvlink_gb_s:.2f} GB/s)",
        )
    gpu_device = device_named(gpu or cluster_gpu(cluster))
    nodes = cluster_named(cluster, gpu_device)
    memory = memory_gb or gpu_device.memory_gb
    fp8 = f", fp8 {gpu_device.fp8_tflops:.0f}" if gpu_device.fp8_tflops else ""
    return Target(
        gpu_device.name,
        memory,
        gpu_device.peak_flops,
        lambda tp, cp, dp: (gpu_device, GPU_EFFICIENCY),
        f"plan for {world} x {gpu_device.name} ({memory:.0f} GiB each, dense bf16 peak "
        f"{gpu_device.peak_tflops:.0f} TFLOP/s{fp8}, HBM {gpu_device.hbm_tb_s:.2f} TB/s) in "
        f"{nodes.name} ({nodes.gpus_per_node} GPUs a node on "
        f"{'NVSwitch' if nodes.nvswitch else 'a shared link'} at {nodes.intra_node_gb_s:.0f} "
        f"GB/s per GPU and direction, {nodes.nics_per_node} x {nodes.nic_gb_s:.1f} GB/s NICs a "
        f"node{', rail-optimized' if nodes.rail_optimized else ''}"
        f"{', SHARP' if nodes.sharp else ''}"
        + (
            f", 1:{nodes.oversubscription:g} above {nodes.pod_gpus} GPUs"
            if nodes.oversubscription > 1
            else ""
        )
        + ")",
        nodes,
    )


class Layout(NamedTuple):
    """The degrees of one layout of the search; dp is what the world leaves."""

    tp: int
    cp: int
    pp: int
    ep: int = 1

    def dp(self, world: int) -> int:
        """The data-parallel degree of this layout on `world` ranks."""
        return world // (self.tp * self.cp * self.pp)


def candidate_layouts(cfg: Config, world: int) -> list[Layout]:
    """Layouts (ep 1) whose tp x cp x pp divides the world and leaves a dp that divides the
    global batch (see module doc)."""
    n_kv = cfg.model.n_kv_head or cfg.model.n_head
    seq_len = cfg.train.seq_len
    out = []
    for tp in (1, 2, 4, 8):
        if cfg.model.n_head % tp or n_kv % tp:
            continue
        if cfg.model.d_ff is not None and cfg.model.d_ff % tp:
            continue
        for cp in (1, 2, 4, 8):
            if cp > 1 and (
                seq_len % (2 * cp) or seq_len // cp < MIN_CP_TOKENS or (seq_len // cp) % tp
            ):
                continue
            for pp in (1, 2, 4, 8, 16, 32, 64):
                if world % (tp * cp * pp) or pp > cfg.model.n_layer:
                    continue
                dp = world // (tp * cp * pp)
                if cfg.train.global_batch_size % dp:
                    continue
                out.append(Layout(tp, cp, pp))
    return out


def _variant(cfg: Config, micro_batch: int, virtual: int) -> Config:
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, micro_batch_size=micro_batch),
        parallel=dataclasses.replace(cfg.parallel, pp_virtual=virtual, pp_layers=None),
    )


def _virtuals(cfg: Config, pp: int, micro_batches: int) -> list[int]:
    if pp == 1:
        return [1]
    n_layer = cfg.model.n_layer
    return [v for v in VIRTUAL if v == 1 or (n_layer % (pp * v) == 0 and micro_batches % pp == 0)]


def _row(cfg: Config, world: int, layout: Layout, tgt: Target, budget: float, **changes) -> Row:
    tp, cp, pp, ep = layout.tp, layout.cp, layout.pp, layout.ep
    device, eff = tgt.device(tp, cp, layout.dp(world))
    memory = estimate(cfg, world, tp, pp, cp, ep, **changes)
    layout_cfg, derived = layout_config(cfg, world, tp, pp, cp, ep, **changes)
    fits = memory.total_gb <= budget
    time = step_time(layout_cfg, derived, device, eff, cluster=tgt.cluster) if fits else None
    ring = ring_ratio(layout_cfg, derived, tgt.peak_flops, device.nvlink_gb_s)
    return Row(layout_cfg, memory, time, ring)


def search(cfg: Config, world: int, tgt: Target) -> tuple[list[Row], list[Row]]:
    """(the config's own micro-batch, v and recompute at every (tp, cp, pp, ep): the memory
    table; every layout of the search that fits, fastest first)."""
    budget = tgt.memory_gib * HEADROOM
    zero = plan_report.searched_zero(cfg)
    layouts = [
        candidate._replace(ep=ep)
        for candidate in candidate_layouts(cfg, world)
        for ep in expert_degrees(cfg, candidate.dp(world))
    ]
    table, fits, seen = [], [], set()
    for layout in layouts:
        dp = layout.dp(world)
        if cfg.train.global_batch_size % (cfg.train.micro_batch_size * dp) == 0:
            table.append(_row(cfg, world, layout, tgt, budget, zero=zero))
        micro = sorted({*MICRO_BATCHES, cfg.train.micro_batch_size})
        for mb in micro:
            if cfg.train.global_batch_size % (mb * dp):
                continue
            micro_batches = cfg.train.global_batch_size // (mb * dp)
            for v in _virtuals(cfg, layout.pp, micro_batches):
                variant = _variant(cfg, mb, v)
                for recompute in RECOMPUTE:
                    key = (layout, mb, v, recompute)
                    if key in seen:
                        continue
                    seen.add(key)
                    row = _row(
                        variant,
                        world,
                        layout,
                        tgt,
                        budget,
                        zero=zero,
                        activation_checkpointing=recompute,
                    )
                    if row.time is not None:
                        fits.append(row)
    fits.sort(key=lambda r: (round(r.time.step_time_s, 9), r.memory.total_gb))
    return table, fits


def parse_layout(text: str, world: int) -> dict[str, int]:
    """{"tp", "pp", "v", "cp", "dp", "ep"} of a --layout string such as "tp=8 pp=8 v=2 cp=1
    dp=24" (missing keys 1; dp the rest of the world); a UserError for an unknown key, a bad
    number or a product that is not --gpus."""
    values = dict.fromkeys(LAYOUT_KEYS, 1)
    given = set()
    for item in text.replace(",", " ").split():
        key, _, value = item.partition("=")
        if key not in values:
            example = "tp=8 pp=8 v=2 cp=1 dp=24"
            raise UserError(
                f"--layout {text!r}: unknown key {key!r}; valid: {', '.join(LAYOUT_KEYS)} "
                f"(e.g. {example!r})"
            )
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"--layout {text!r}: {key}={value!r} must be a positive integer")
        values[key] = int(value)
        given.add(key)
    product = values["tp"] * values["cp"] * values["pp"]
    if "dp" not in given:
        values["dp"] = max(1, world // product)
    if product * values["dp"] != world:
        raise UserError(
            f"--layout {text!r}: tp x cp x dp x pp = {values['tp']} x {values['cp']} x "
            f"{values['dp']} x {values['pp']} = {product * values['dp']}, not --gpus {world}"
        )
    return values


def fixed_layout(cfg: Config, world: int, text: str, tgt: Target) -> Row:
    """The one layout of --layout, with the config's micro-batch, global batch, sequence,
    recompute, precision, sequence parallelism and ZeRO as given."""
    values = parse_layout(text, world)
    parallel = dataclasses.replace(
        cfg.parallel,
        tp=values["tp"],
        pp=values["pp"],
        cp=values["cp"],
        dp=values["dp"],
        ep=values["ep"],
        pp_virtual=values["v"],
        pp_layers=None,
        sequence_parallel=cfg.parallel.sequence_parallel and values["tp"] > 1,
    )
    layout_cfg = dataclasses.replace(cfg, parallel=parallel)
    try:
        derived = derive(layout_cfg, world, vocab_size=cfg.model.vocab_size)
    except UserError as exc:
        raise UserError(f"--layout {text!r}: {exc}") from None
    device, eff = tgt.device(derived.tp, derived.cp, derived.dp)
    memory = estimate(
        layout_cfg,
        world,
        derived.tp,
        derived.pp,
        derived.cp,
        derived.ep,
        sequence_parallel=parallel.sequence_parallel,
        zero=cfg.optim.zero,
        activation_checkpointing=cfg.train.activation_checkpointing,
    )
    ring = ring_ratio(layout_cfg, derived, tgt.peak_flops, device.nvlink_gb_s)
    return Row(
        layout_cfg, memory, step_time(layout_cfg, derived, device, eff, cluster=tgt.cluster), ring
    )


def _check_fp8(cfg: Config, tgt: Target, device: str) -> None:
    """train.precision fp8 needs a GPU with fp8 tensor cores (a UserError otherwise)."""
    if device == "gpu" and cfg.train.precision == "fp8":
        gpu, _ = tgt.device(1, 1, 1)
        if not gpu.fp8_tflops:
            raise UserError(
                f"train.precision=fp8: the {gpu.name} has no fp8 tensor cores (no dense fp8 "
                "peak); use train.precision=bf16 or an fp8 GPU (H100, H200, B200, ...)"
            )


def plan(
    cfg: Config,
    gpus: int | None,
    gpu: str | None,
    memory_gb: float | None,
    layout: str | None = None,
    as_json: bool = False,
    device: str = "gpu",
    calibration: str | None = None,
    show: int = plan_report.SHOWN,
    cluster: str | None = None,
) -> str:
    """The report `megatronish plan` prints (one JSON object with as_json); `show`: the fastest
    fitting layouts it lists (0: all); `cluster`: --cluster."""
    with remembering():  # the configs plan builds never change
        return _plan(cfg, gpus, gpu, memory_gb, layout, as_json, device, calibration, show, cluster)


def _plan(
    cfg: Config,
    gpus: int | None,
    gpu: str | None,
    memory_gb: float | None,
    layout: str | None,
    as_json: bool,
    device: str,
    calibration: str | None,
    show: int,
    cluster: str | None,
) -> str:
    if cfg.model.vocab_size is None:  # the data's vocabulary, as training takes it
        model = dataclasses.replace(cfg.model, vocab_size=data_vocab_size(cfg))
        cfg = dataclasses.replace(cfg, model=model)
    world = gpus if gpus is not None else world_size_of(cfg)
    if world < 1:
        raise UserError(f"--gpus {gpus}: must be >= 1")
    tgt = target(gpu, memory_gb, device, calibration, world, cluster)
    _check_fp8(cfg, tgt, device)
    if layout is not None:
        row = fixed_layout(cfg, world, layout, tgt)
        budget = tgt.memory_gib * HEADROOM
        if as_json:
            return plan_report.as_json(row, tgt.name, world, budget)
        text = plan_report.one_layout(row, tgt.title, budget, explanation([row], world, tgt))
        return "\n".join([text, *_reference_lines(cfg, row)])
    if not candidate_layouts(cfg, world):
        raise UserError(
            f"no tensor-parallel degree in 1, 2, 4, 8 fits {world} GPUs with model.n_head="
            f"{cfg.model.n_head} and train.global_batch_size={cfg.train.global_batch_size}"
        )
    table, fits = search(cfg, world, tgt)
    budget = tgt.memory_gib * HEADROOM
    if as_json:
        if not fits:
            raise UserError(f"no layout of {world} x {tgt.name} fits {budget:.1f} GiB per rank")
        return plan_report.as_json(fits[0], tgt.name, world, budget)
    if show < 0:
        raise UserError(f"--show {show}: must be >= 0 (0: every layout that fits)")
    explain = explanation(fits, world, tgt) if fits else []
    text = plan_report.report(cfg, table, fits, tgt.title, budget, show or len(fits), explain)
    return "\n".join([text, *(_reference_lines(cfg, fits[0]) if fits else [])])


def _reference_lines(cfg: Config, row: Row) -> list[str]:
    """DPO's reference pass at this layout's predicted step (commands.dpo_pass)."""
    if row.time is None:
        return []
    return reference_pass_lines(cfg, row.time.model_flops, row.time.step_time_s)
