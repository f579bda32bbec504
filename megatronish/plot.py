"""`megatronish plot`: loss, learning rate and throughput curves from a run's metrics.jsonl."""

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


def plot_run(run_dir: str, output: str | None) -> Path:
    """Writes a PNG with three panels (loss and val_loss, lr, tokens/s) and returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plot needs matplotlib: pip install matplotlib") from None
    train, evals = read_run(Path(run_dir))
    out = Path(output) if output else Path(run_dir) / "curves.png"
    steps = [r["step"] for r in train]
    fig, (ax_loss, ax_lr, ax_tps) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
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
    ax_tps.set_xlabel("step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
