"""`megatronish plot`: loss, learning rate and throughput curves from a run's metrics.jsonl, and
(when the run recorded phase times) the ranks' phase times and peak memory."""

from __future__ import annotations

import json
from pathlib import Path

from megatronish.errors import UserError


def read_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of run_dir/metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist; give the run.out_dir of a training run")
    train, evals = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}: line {number} is not JSON") from None
        if "loss" in record:
            train.append(record)
        elif "val_loss" in record:
            evals.append(record)
    if not train:
        raise UserError(f"{path}: no training lines (with 'step' and 'loss')")
    return train, evals


PHASE_CURVES = ("forward_s", "backward_s", "bubble_s", "grad_sync_s", "optimizer_s", "compute_s")


def plot_run(run_dir: str, output: str | None) -> Path:
    """Writes a PNG with three panels (loss and val_loss, lr, tokens/s), and two more when the
    run has phase times: each phase's median over the ranks with the band from the fastest to
    the slowest rank, and peak memory (the largest rank's and the median); returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plot needs matplotlib: pip install matplotlib") from None
    train, evals = read_run(Path(run_dir))
    out = Path(output) if output else Path(run_dir) / "curves.png"
    fig = draw_curves(train, evals, str(run_dir))
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out


def draw_curves(train: list[dict], evals: list[dict], title: str):
    """The figure plot_run writes. The axes of absolute quantities (learning rate, tokens/s,
    seconds, memory) start at zero, so a flat curve looks flat; the loss axis spans the loss."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    observed = [r for r in train if "phases" in r]
    panels = 5 if observed else 3
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3 * panels), sharex=True)
    ax_loss, ax_lr, ax_tps = axes[:3]
    ax_loss.plot(steps, [r["loss"] for r in train], label="train loss")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val loss"
        )
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_lr.plot(steps, [r.get("lr", float("nan")) for r in train])
    ax_lr.set_ylabel("learning rate")
    ax_tps.plot(steps, [r.get("tokens_per_s", float("nan")) for r in train])
    ax_tps.set_ylabel("tokens / s")
    if observed:
        _phase_panels(axes[3], axes[4], observed)
    for ax in axes[1:]:
        ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _phase_panels(ax_time, ax_memory, records: list[dict]) -> None:
    steps = [r["step"] for r in records]
    for name in PHASE_CURVES:
        stats = [r["phases"].get(name) for r in records]
        if not all(stats) or max(s["max"] for s in stats) == 0:
            continue
        line = ax_time.plot(steps, [s["median"] for s in stats], label=name.removesuffix("_s"))
        ax_time.fill_between(
            steps,
            [s["min"] for s in stats],
            [s["max"] for s in stats],
            color=line[0].get_color(),
            alpha=0.2,
        )
    ax_time.set_ylabel("s per step (ranks:\nmedian, min-max)")
    ax_time.legend(fontsize="small", ncol=3)
    memory = [r["phases"]["peak_memory"] for r in records]
    ax_memory.plot(steps, [m["max"] / 2**30 for m in memory], label="largest rank")
    ax_memory.plot(steps, [m["median"] / 2**30 for m in memory], label="median rank")
    ax_memory.set_ylabel("peak memory GiB")
    ax_memory.legend(fontsize="small")
