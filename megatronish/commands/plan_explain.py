"""Why `megatronish plan` recommends what it does: the predicted breakdown of the recommended
layout beside the runner-up's (``side_by_side``), the GEMMs of a layer that are memory-bound
(``memory_bound_line``), and the one change to the recommended config that would shorten its
step the most (``best_change``), each change a megatronish config key the run can set."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from megatronish.accounting.cluster import Cluster
from megatronish.accounting.hardware import Device
from megatronish.accounting.layer_time import gemm_table
from megatronish.accounting.roofline import Efficiency
from megatronish.accounting.step_time import PARTS, StepTime, step_time
from megatronish.config import Config, derive
from megatronish.errors import UserError


class Change(NamedTuple):
    """A single change to the config: what it does, the --set option that makes it, the
    changed config."""

    what: str
    option: str
    cfg: Config


def _candidates(cfg: Config, device: Device) -> list[Change]:
    """Each single change that could help: what the run overlaps
    (tp communication, the dp reduction), the precision of the gradient reduction and of the
    GEMMs, sequence parallelism."""
    parallel, optim, train = cfg.parallel, cfg.optim, cfg.train
    out = []

    def change(what: str, key: str, value: str, section: str, **fields) -> None:
        section_cfg = dataclasses.replace(getattr(cfg, section), **fields)
        changed = dataclasses.replace(cfg, **{section: section_cfg})
        out.append(Change(what, f"--set {key}={value}", changed))

    if parallel.tp > 1 and not parallel.tp_comm_overlap:
        change(
            "tp overlap on", "parallel.tp_comm_overlap", "true", "parallel", tp_comm_overlap=True
        )
    if parallel.tp > 1 and not parallel.sequence_parallel and not cfg.model.moe.num_experts:
        change(
            "sequence parallel on",
            "parallel.sequence_parallel",
            "true",
            "parallel",
            sequence_parallel=True,
        )
    if not optim.overlap_grad_reduce:
        change(
            "dp overlap on", "optim.overlap_grad_reduce", "true", "optim", overlap_grad_reduce=True
        )
    fields = {f.name for f in dataclasses.fields(optim)}
    if "grad_reduce_dtype" in fields and optim.grad_reduce_dtype == "fp32":
        change(
            "bf16 gradient reduction",
            "optim.grad_reduce_dtype",
            "bf16",
            "optim",
            grad_reduce_dtype="bf16",
        )
    if train.precision == "bf16" and device.fp8_tflops:
        change("fp8 GEMMs", "train.precision", "fp8", "train", precision="fp8")
    return out


def best_change(
    cfg: Config, world: int, device: Device, eff: Efficiency, cluster: Cluster | None, now: float
) -> str | None:
    """The single change (``_candidates``) that shortens the predicted step the most, as
    "tp overlap on: -0.21 s (--set parallel.tp_comm_overlap=true)"; None if none helps. Memory
    is not rechecked: these changes hold or lower it."""
    best, best_saved = None, 0.0
    for candidate in _candidates(cfg, device):
        changed = candidate.cfg
        try:
            derived = derive(changed, world, vocab_size=changed.model.vocab_size)
        except UserError:  # a combination the trainer refuses
            continue
        saved = now - step_time(changed, derived, device, eff, cluster=cluster).step_time_s
        if saved > 0 and (best is None or saved > best_saved):
            best, best_saved = candidate, saved
    if best is None:
        return None
    return f"{best.what}: -{best_saved:.3g} s a step ({best.option})"


def explanation(rows: list, world: int, tgt) -> list[str]:
    """plan's explanation of its pick (module doc): rows, the fitting layouts fastest first;
    tgt, plan's Target."""
    best = rows[0]
    p = best.cfg.parallel
    device, eff = tgt.device(p.tp, p.cp, p.dp)
    lines = ["", "why this layout:"]
    if len(rows) > 1:
        lines.append(f"recommended {_name(best)}; runner-up {_name(rows[1])}")
        lines += side_by_side(best.time, rows[1].time, ("recommended", "runner-up"))
    lines.append(memory_bound_line(best.cfg, world, device, eff))
    change = best_change(best.cfg, world, device, eff, tgt.cluster, best.time.step_time_s)
    lines.append(
        f"the change that would help most: {change or 'none of the overlaps or precisions'}"
    )
    return lines


def _name(row) -> str:
    p, t = row.cfg.parallel, row.cfg.train
    v = p.pp_virtual if p.pp > 1 else 1
    return (
        f"tp={p.tp} cp={p.cp} dp={p.dp} pp={p.pp} v={v} ep={p.ep}, micro-batch "
        f"{t.micro_batch_size}, recompute {t.activation_checkpointing}"
    )


def side_by_side(first: StepTime, second: StepTime, names: tuple[str, str]) -> list[str]:
    """The two breakdowns, ms per step, part by part, and their steps."""
    lines = [f"{'ms per step':>16} {names[0]:>14} {names[1]:>14}"]
    for part in PARTS:
        lines.append(
            f"{part:>16} {1e3 * first.breakdown[part]:>14.1f} {1e3 * second.breakdown[part]:>14.1f}"
        )
    lines.append(f"{'step':>16} {1e3 * first.step_time_s:>14.1f} {1e3 * second.step_time_s:>14.1f}")
    return lines


def memory_bound_line(cfg: Config, world: int, device: Device, eff: Efficiency) -> str:
    """The GEMMs of a layer (and the output layer) that are memory-bound, or that none is,
    with the lowest share of the peak a GEMM reaches."""
    derived = derive(cfg, world, vocab_size=cfg.model.vocab_size)
    rows = gemm_table(cfg, derived, device, eff)
    bound = [f"{r['gemm']} {r['pass_']}" for r in rows if r["memory_bound"]]
    low = min(rows, key=lambda r: r["share"])
    worst = f"{low['gemm']} {low['pass_']} [{low['m']}, {low['k']}] x [{low['k']}, {low['n']}]"
    return (
        "GEMMs: "
        + (f"memory-bound: {', '.join(bound)}" if bound else "none memory-bound")
        + f"; the least efficient, {worst}, at {100 * low['share']:.0f}% of the peak"
    )
