"""What `megatronish plan` prints: the memory table of the config's own settings at every
layout, the fastest layouts of the search with their predicted step and its breakdown, the
recommendation; or one layout as text or JSON. Every figure says its unit and scope: memory
in GiB (2^30 bytes) per rank, of the fullest pipeline stage; traffic in GiB a rank sends per
step; times in seconds or milliseconds per step."""

from __future__ import annotations

import json

from megatronish.accounting.muon import STATE_LABEL
from megatronish.accounting.step_time import PARTS, StepTime
from megatronish.config import Config

SHOWN = 12  # fastest layouts listed
SHORT = {
    "compute": "compute",
    "exposed_tp": "tp",
    "exposed_cp": "cp",
    "exposed_ep": "ep",
    "exposed_dp": "dp",
    "pipeline_bubble": "bubble",
    "pipeline_sends": "sends",
    "optimizer": "optim",
}


def _layout(row) -> dict:
    parallel, train = row.cfg.parallel, row.cfg.train
    return {
        "tp": parallel.tp,
        "cp": parallel.cp,
        "dp": parallel.dp,
        "pp": parallel.pp,
        "v": row.memory.pp_virtual,
        "ep": parallel.ep,
        "micro_batch_size": train.micro_batch_size,
        "activation_checkpointing": train.activation_checkpointing,
        "sequence_parallel": bool(parallel.sequence_parallel and parallel.tp > 1),
        "tp_comm_overlap": bool(parallel.tp_comm_overlap and parallel.tp > 1),
        "zero": row.cfg.optim.zero,
    }


def as_json(row, gpu: str, world: int, budget: float) -> str:
    """One JSON object: the layout, its memory and its predicted step."""
    predicted = row.time
    return json.dumps(
        {
            "gpu": gpu,
            "gpus": world,
            "layout": _layout(row),
            "step_time_s": predicted.step_time_s,
            "tokens_per_s": predicted.tokens_per_s,
            "model_tflops_per_gpu": predicted.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": predicted.hardware_tflops_per_gpu,
            "mfu": predicted.mfu,
            "hfu": predicted.hfu,
            "memory_gb": row.memory.total_gb,
            "fits": row.memory.total_gb <= budget,
            "breakdown": predicted.breakdown,
            "tp_exposed_s": predicted.breakdown["exposed_tp"],
            "tp_hidden_s": predicted.tp_hidden_s,
            "units": {
                "memory_gb": "GiB (2^30 bytes) per rank, of the fullest pipeline stage",
                "breakdown": "seconds per step, summing to step_time_s",
                "tp_exposed_s": "seconds per step of tp communication on the critical path "
                "(breakdown's exposed_tp)",
                "tp_hidden_s": "seconds per step of tp communication hidden under the GEMMs "
                "(parallel.tp_comm_overlap)",
                "tflops_per_gpu": "TFLOP/s per GPU: model FLOPs (no recompute) and hardware "
                "FLOPs (with recompute)",
                "mfu": "of the dense bf16 peak, as published tables quote it (under fp8 too)",
            },
        }
    )


def _time_cells(step: StepTime) -> str:
    return (
        f"{step.step_time_s:>9.4g} {step.tokens_per_s:>10.0f} {step.model_tflops_per_gpu:>7.4g} "
        f"{step.hardware_tflops_per_gpu:>7.4g} {100 * step.mfu:>5.1f} {100 * step.hfu:>5.1f} "
        + " ".join(f"{1e3 * step.breakdown[p]:>8.1f}" for p in PARTS)
    )


TIME_HEADER = (
    f"{'step s':>9} {'tokens/s':>10} {'model':>7} {'hw':>7} {'MFU%':>5} {'HFU%':>5} "
    + " ".join(f"{SHORT[p]:>8}" for p in PARTS)
)
MFU_NOTE = "MFU and HFU are of the dense bf16 peak, as published tables quote them (under fp8 too)"
TIME_LEGEND = (
    "step s: predicted seconds per step; tokens/s: of the whole run; model / hw: TFLOP/s per GPU "
    "counting model FLOPs (MFU) / hardware FLOPs with recompute (HFU); then ms per step: "
    "compute, exposed tp, cp, ep and dp communication, pipeline bubble, pipeline sends, "
    "optimizer"
)


def searched_zero(cfg: Config) -> int:
    """The ZeRO level plan searches at: the config's, 1 at least (its state sharding costs no
    traffic; Muon's matrices owned whole, by one rank each)."""
    return max(1, cfg.optim.zero)


def one_layout(row, title: str, budget: float, explain: list[str]) -> str:
    """One layout as text: memory per rank, the predicted step and `explain`
    (commands.plan_explain)."""
    memory, lay = row.memory, _layout(row)
    fits = "fits" if memory.total_gb <= budget else f"does NOT fit {budget:.1f} GiB"
    return "\n".join(
        [
            title,
            "",
            "layout: "
            + " ".join(f"{k}={lay[k]}" for k in ("tp", "pp", "v", "cp", "dp", "ep"))
            + f", micro-batch {lay['micro_batch_size']}, recompute "
            f"{lay['activation_checkpointing']}",
            f"memory per rank (GiB = 2^30 bytes, fullest stage): {memory.total_gb:.2f} ({fits}): "
            f"weights {memory.weights_gb:.2f}, gradients {memory.grads_gb:.2f}, "
            f"{STATE_LABEL[row.cfg.optim.name]} "
            f"{memory.optimizer_gb:.2f}"
            + (f", gathered in a step {memory.gathered_gb:.2f}" if memory.gathered_gb else "")
            + f" (optim.zero={lay['zero']}), activations {memory.activations_gb:.2f}, logits "
            f"{memory.logits_gb:.2f}",
            TIME_HEADER,
            _time_cells(row.time),
            TIME_LEGEND,
            MFU_NOTE,
            *explain[2:],
        ]
    )


def report(
    cfg: Config,
    table: list,
    fits: list,
    title: str,
    budget: float,
    show: int = SHOWN,
    explain: list[str] | None = None,
) -> str:
    """The search's report (see module doc), with `explain` (commands.plan_explain) before the
    recommendation."""
    moe = cfg.model.moe.num_experts > 0
    zero = searched_zero(cfg)
    lines = [title, "", *_table_lines(cfg, table, budget, moe, zero)]
    lines += _fastest_lines(fits, budget, show, zero, moe)
    if not fits:
        lines.append(
            f"does not fit: no layout stays under {budget:.1f} GiB per rank; use more GPUs, a "
            "smaller train.micro_batch_size or a GPU with more memory"
        )
        return "\n".join(lines)
    lines += [*(explain or []), _recommendation(fits[0], moe)]
    return "\n".join(lines)


def _table_lines(cfg: Config, table: list, budget: float, moe: bool, zero: int) -> list[str]:
    """Every layout of the search at the config's micro-batch and recompute: its memory, its
    traffic and, where it fits, its predicted step."""
    gathered = zero >= 2
    lines = [
        f"{'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3} "
        + (f"{'ep':>3} {'experts':>8} " if moe else "")
        + f"{'bubble':>6} {'v':>2} {'ring':>5} {'sp':>3} {'recompute':>9} "
        f"{'weights':>8} {'grads':>7} {'adam':>7} "
        + (f"{'gather':>7} " if gathered else "")
        + f"{'activ.':>8} {'logits':>7} {'total':>7} {'sent':>8} {'step s':>8}",
        f"(at the config's micro-batch {cfg.train.micro_batch_size} and recompute; memory"
        + (" (experts: of it the experts')" if moe else "")
        + (f" at ZeRO-{zero} (gather: what a step holds beyond the shards)" if gathered else "")
        + ": GiB (2^30 bytes) per rank, of the fullest pipeline stage; sent: GiB a rank sends "
        "per step; "
        "ring: cp transfer / block compute; step s: predicted seconds per step where it fits)",
    ]
    for row in table:
        memory = row.memory
        mark = "  <- fits" if memory.total_gb <= budget else ""
        ring = "-" if row.ring_ratio is None else f"{row.ring_ratio:.2f}"
        experts = f"{memory.ep:>3} {memory.expert_gb:>8.2f} " if moe else ""
        step = "-" if row.time is None else f"{row.time.step_time_s:.3f}"
        lines.append(
            f"{memory.tp:>3} {memory.cp:>3} {memory.dp:>4} {memory.pp:>3} {experts}"
            f"{memory.bubble:>6.2f} {memory.pp_virtual:>2} {ring:>5} "
            f"{'y' if memory.sequence_parallel else 'n':>3} "
            f"{memory.activation_checkpointing:>9} {memory.weights_gb:>8.2f} "
            f"{memory.grads_gb:>7.2f} {memory.optimizer_gb:>7.2f} "
            + (f"{memory.gathered_gb:>7.2f} " if gathered else "")
            + f"{memory.activations_gb:>8.2f} {memory.logits_gb:>7.2f} "
            f"{memory.total_gb:>7.2f} {memory.comm_gb_per_step:>8.2f} {step:>8}{mark}"
        )
    return lines


def _fastest_lines(fits: list, budget: float, show: int, zero: int, moe: bool) -> list[str]:
    """The `show` fastest layouts that fit, with the legend of their columns."""
    lines = [
        "",
        f"fastest layouts that fit {budget:.1f} GiB per rank ({min(show, len(fits))} "
        f"of the {len(fits)} that fit, --show N for more; "
        "searching tp, cp, pp, v, dp, ep, micro-batch, recompute; "
        f"{_sequence_parallel(fits, moe)}, ZeRO-{zero}):",
        f"{'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3} {'v':>2} {'ep':>3} {'mb':>3} {'recompute':>9} "
        f"{'GiB':>6} " + TIME_HEADER,
    ]
    for row in fits[:show]:
        lay = _layout(row)
        lines.append(
            f"{lay['tp']:>3} {lay['cp']:>3} {lay['dp']:>4} {lay['pp']:>3} {lay['v']:>2} "
            f"{lay['ep']:>3} {lay['micro_batch_size']:>3} {lay['activation_checkpointing']:>9} "
            f"{row.memory.total_gb:>6.2f} " + _time_cells(row.time)
        )
    return [*lines, TIME_LEGEND, MFU_NOTE, ""]


def _sequence_parallel(fits: list, moe: bool) -> str:
    """What the listed layouts do with sequence parallelism: on at tp > 1, or off where a
    layout at tp > 1 runs without it (with experts: accounting.memory.layout_config)."""
    if any(row.cfg.parallel.tp > 1 and not row.cfg.parallel.sequence_parallel for row in fits):
        return "no sequence parallel" + (" (not with experts)" if moe else "")
    return "sequence parallel at tp > 1"


def _recommendation(best, moe: bool) -> str:
    """The --set options of the fastest layout that fits, with its memory and its step."""
    lay, predicted = _layout(best), best.time
    return (
        f"recommended: --set parallel.tp={lay['tp']} --set parallel.cp={lay['cp']} "
        f"--set parallel.dp={lay['dp']} --set parallel.pp={lay['pp']} "
        + (f"--set parallel.ep={lay['ep']} " if moe else "")
        + (f"--set parallel.pp_virtual={lay['v']} " if lay["v"] > 1 else "")
        + f"--set parallel.sequence_parallel={str(lay['sequence_parallel']).lower()} "
        f"--set optim.zero={lay['zero']} --set train.micro_batch_size={lay['micro_batch_size']} "
        f"--set train.activation_checkpointing={lay['activation_checkpointing']} "
        f"({best.memory.total_gb:.3g} GiB per rank; predicted {predicted.step_time_s:.4g} s per "
        f"step, {predicted.tokens_per_s:,.0f} tokens/s, {predicted.model_tflops_per_gpu:.4g} "
        f"model TFLOP/s per GPU, MFU {100 * predicted.mfu:.1f}%)"
    )
