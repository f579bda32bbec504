"""What `megatronish plan` prints: the memory table of the config's own settings at every
layout, the fastest layouts of the search with their predicted step and its breakdown, the
recommendation; or one layout as text or JSON. Every figure says its unit and scope: memory
in GiB (2^30 bytes) per rank, of the fullest pipeline stage; traffic in GiB a rank sends per
step; times in seconds or milliseconds per step."""

from __future__ import annotations

import json

from megatronish.accounting.step_time import PARTS
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
    p, t = row.cfg.parallel, row.cfg.train
    return {
        "tp": p.tp,
        "cp": p.cp,
        "dp": p.dp,
        "pp": p.pp,
        "v": row.memory.pp_virtual,
        "ep": p.ep,
        "micro_batch_size": t.micro_batch_size,
        "activation_checkpointing": t.activation_checkpointing,
        "sequence_parallel": bool(p.sequence_parallel and p.tp > 1),
        "zero": row.cfg.optim.zero,
    }


def as_json(row, gpu: str, world: int, budget: float) -> str:
    """One JSON object: the layout, its memory and its predicted step."""
    t = row.time
    return json.dumps(
        {
            "gpu": gpu,
            "gpus": world,
            "layout": _layout(row),
            "step_time_s": t.step_time_s,
            "tokens_per_s": t.tokens_per_s,
            "model_tflops_per_gpu": t.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": t.hardware_tflops_per_gpu,
            "mfu": t.mfu,
            "hfu": t.hfu,
            "memory_gb": row.memory.total_gb,
            "fits": row.memory.total_gb <= budget,
            "breakdown": t.breakdown,
            "units": {
                "memory_gb": "GiB (2^30 bytes) per rank, of the fullest pipeline stage",
                "breakdown": "seconds per step, summing to step_time_s",
                "tflops_per_gpu": "TFLOP/s per GPU: model FLOPs (no recompute) and hardware "
                "FLOPs (with recompute)",
            },
        }
    )


def _time_cells(t) -> str:
    return (
        f"{t.step_time_s:>9.4g} {t.tokens_per_s:>10.0f} {t.model_tflops_per_gpu:>7.4g} "
        f"{t.hardware_tflops_per_gpu:>7.4g} {100 * t.mfu:>5.1f} {100 * t.hfu:>5.1f} "
        + " ".join(f"{1e3 * t.breakdown[p]:>8.1f}" for p in PARTS)
    )


TIME_HEADER = (
    f"{'step s':>9} {'tokens/s':>10} {'model':>7} {'hw':>7} {'MFU%':>5} {'HFU%':>5} "
    + " ".join(f"{SHORT[p]:>8}" for p in PARTS)
)
TIME_LEGEND = (
    "step s: predicted seconds per step; tokens/s: of the whole run; model / hw: TFLOP/s per GPU "
    "counting model FLOPs (MFU) / hardware FLOPs with recompute (HFU); then ms per step: "
    "compute, exposed tp, cp, ep and dp communication, pipeline bubble, pipeline sends, "
    "optimizer"
)


def one_layout(row, title: str, budget: float) -> str:
    """One layout as text: memory per rank and the predicted step."""
    e, lay = row.memory, _layout(row)
    fits = "fits" if e.total_gb <= budget else f"does NOT fit {budget:.1f} GiB"
    return "\n".join(
        [
            title,
            "",
            "layout: "
            + " ".join(f"{k}={lay[k]}" for k in ("tp", "pp", "v", "cp", "dp", "ep"))
            + f", micro-batch {lay['micro_batch_size']}, recompute "
            f"{lay['activation_checkpointing']}",
            f"memory per rank (GiB = 2^30 bytes, fullest stage): {e.total_gb:.2f} ({fits}): "
            f"weights {e.weights_gb:.2f}, gradients {e.grads_gb:.2f}, AdamW "
            f"{e.optimizer_gb:.2f}"
            + (f", gathered in a step {e.gathered_gb:.2f}" if e.gathered_gb else "")
            + f" (optim.zero={lay['zero']}), activations {e.activations_gb:.2f}, logits "
            f"{e.logits_gb:.2f}",
            TIME_HEADER,
            _time_cells(row.time),
            TIME_LEGEND,
        ]
    )


def report(
    cfg: Config, table: list, fits: list, title: str, budget: float, show: int = SHOWN
) -> str:
    """The search's report (see module doc)."""
    moe = cfg.model.moe.num_experts > 0
    zero = max(1, cfg.optim.zero)  # plan's ZeRO level (search)
    gathered = zero >= 2
    lines = [
        title,
        "",
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
        e = row.memory
        mark = "  <- fits" if e.total_gb <= budget else ""
        ring = "-" if row.ring_ratio is None else f"{row.ring_ratio:.2f}"
        experts = f"{e.ep:>3} {e.expert_gb:>8.2f} " if moe else ""
        step = "-" if row.time is None else f"{row.time.step_time_s:.3f}"
        lines.append(
            f"{e.tp:>3} {e.cp:>3} {e.dp:>4} {e.pp:>3} {experts}{e.bubble:>6.2f} "
            f"{e.pp_virtual:>2} {ring:>5} {'y' if e.sequence_parallel else 'n':>3} "
            f"{e.activation_checkpointing:>9} {e.weights_gb:>8.2f} {e.grads_gb:>7.2f} "
            f"{e.optimizer_gb:>7.2f} "
            + (f"{e.gathered_gb:>7.2f} " if gathered else "")
            + f"{e.activations_gb:>8.2f} {e.logits_gb:>7.2f} "
            f"{e.total_gb:>7.2f} {e.comm_gb_per_step:>8.2f} {step:>8}{mark}"
        )
    lines += [
        "",
        f"fastest layouts that fit {budget:.1f} GiB per rank ({min(show, len(fits))} "
        f"of the {len(fits)} that fit, --show N for more; "
        "searching tp, cp, pp, v, dp, ep, micro-batch, recompute; sequence parallel at "
        f"tp > 1, ZeRO-{zero}):",
    ]
    lines.append(
        f"{'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3} {'v':>2} {'ep':>3} {'mb':>3} {'recompute':>9} "
        f"{'GiB':>6} " + TIME_HEADER
    )
    for row in fits[:show]:
        lay = _layout(row)
        lines.append(
            f"{lay['tp']:>3} {lay['cp']:>3} {lay['dp']:>4} {lay['pp']:>3} {lay['v']:>2} "
            f"{lay['ep']:>3} {lay['micro_batch_size']:>3} {lay['activation_checkpointing']:>9} "
            f"{row.memory.total_gb:>6.2f} " + _time_cells(row.time)
        )
    lines += [TIME_LEGEND, ""]
    if not fits:
        lines.append(
            f"does not fit: no layout stays under {budget:.1f} GiB per rank; use more GPUs, a "
            "smaller train.micro_batch_size or a GPU with more memory"
        )
        return "\n".join(lines)
    best, lay = fits[0], _layout(fits[0])
    t = best.time
    lines.append(
        f"recommended: --set parallel.tp={lay['tp']} --set parallel.cp={lay['cp']} "
        f"--set parallel.dp={lay['dp']} --set parallel.pp={lay['pp']} "
        + (f"--set parallel.ep={lay['ep']} " if moe else "")
        + (f"--set parallel.pp_virtual={lay['v']} " if lay["v"] > 1 else "")
        + f"--set parallel.sequence_parallel={str(lay['sequence_parallel']).lower()} "
        f"--set optim.zero={lay['zero']} --set train.micro_batch_size={lay['micro_batch_size']} "
        f"--set train.activation_checkpointing={lay['activation_checkpointing']} "
        f"({best.memory.total_gb:.3g} GiB per rank; predicted {t.step_time_s:.4g} s per step, "
        f"{t.tokens_per_s:,.0f} tokens/s, {t.model_tflops_per_gpu:.4g} model TFLOP/s per GPU, "
        f"MFU {100 * t.mfu:.1f}%)"
    )
    return "\n".join(lines)
