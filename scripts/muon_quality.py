"""Muon's training quality against AdamW's: the tiny Llama of scripts/fp8_quality.py (2 layers,
d_model 128) trained on the built-in corpus by each optimizer at its own best learning rate.
First a sweep: one --sweep-steps run a learning rate (seed FIRST_SEED, min_lr a tenth of lr,
the same warmup), the best by its final loss (the mean training loss of its last --every
steps); then --steps steps at that rate with each of --seeds seeds (train.seed: the
initialization and the batch order), AdamW and Muon paired seed by seed (the same
initializations, the same batches). One CPU process and one thread a run, --jobs runs at a time.
A curve is, at every --every-th step, the loss averaged over the --every steps up to it and
over the seeds. Printed: the sweep, the curves and the table (optimizer, lr, final loss mean
+- std over the seeds, the first step each mean curve reaches AdamW's final loss); written to
FIGURES/muon-quality.json (the sweep and every seed's curve) and FIGURES/muon-quality.png
(the curves, the band of the seeds' lowest and highest, and the sweep), the table also to
OUT/table.md. --reuse keeps a run whose metrics already hold its steps.

    python scripts/muon_quality.py [--steps 300] [--sweep-steps 100] [--every 10] [--seeds 3]
        [--adamw-lr 1e-3 3e-3 1e-2] [--muon-lr 1e-3 3e-3 1e-2 3e-2] [--jobs 2]
        [--out muon_quality] [--figures docs] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from quality_runs import FIRST_SEED, host, mean_curve, run_all, run_dir, train

OPTIMIZERS = {"AdamW": ["optim.name=adamw"], "Muon": ["optim.name=muon"]}
BASE = "AdamW"  # the optimizer whose final loss the others are timed to


def lr_sets(lr: float) -> list[str]:
    """The learning-rate settings of a run: peak lr, decayed to a tenth of it."""
    return [f"train.lr={lr:g}", f"train.min_lr={lr / 10:g}"]


def steps_to(curve: dict[int, float], target: float) -> int | None:
    """The first logged step whose loss is at most target (None: never)."""
    return next((step for step in sorted(curve) if curve[step] <= target), None)


def sweep(args: argparse.Namespace, out: Path) -> dict[str, dict[float, float]]:
    """optimizer -> lr -> the final loss of its sweep run."""
    lrs = {"AdamW": args.adamw_lr, "Muon": args.muon_lr}
    runs = [(name, lr) for name in OPTIMIZERS for lr in lrs[name]]

    def run(job: tuple[str, float]) -> float:
        name, lr = job
        sets = [*OPTIMIZERS[name], *lr_sets(lr), f"train.seed={FIRST_SEED}"]
        where = run_dir(out / "sweep", f"{name} lr{lr:g}", FIRST_SEED)
        curve = train(sets, args.sweep_steps, args.every, where, args.reuse)
        return curve[max(curve)]

    done = run_all(args.jobs, run, runs)
    return {name: {lr: done[(name, lr)] for lr in lrs[name]} for name in OPTIMIZERS}


def seed_runs(args: argparse.Namespace, out: Path, best: dict[str, float]) -> dict:
    """optimizer -> train.seed -> its curve over --steps steps at its best lr."""
    seeds = range(FIRST_SEED, FIRST_SEED + args.seeds)
    runs = [(name, seed) for name in OPTIMIZERS for seed in seeds]

    def run(job: tuple[str, int]) -> dict[int, float]:
        name, seed = job
        sets = [*OPTIMIZERS[name], *lr_sets(best[name]), f"train.seed={seed}"]
        return train(sets, args.steps, args.every, run_dir(out, name, seed), args.reuse)

    done = run_all(args.jobs, run, runs)
    return {name: {seed: done[(name, seed)] for seed in seeds} for name in OPTIMIZERS}


def summary(runs: dict, best: dict[str, float]) -> list[dict]:
    """Per optimizer: its lr, final loss mean and std over the seeds, and the first step its
    mean curve reaches the base optimizer's final mean loss."""
    means = {name: mean_curve(list(curves.values())) for name, curves in runs.items()}
    target = means[BASE][max(means[BASE])]
    rows = []
    for name, curves in runs.items():
        finals = [curve[max(curve)] for curve in curves.values()]
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        rows.append(
            dict(
                optimizer=name,
                lr=best[name],
                final_mean=statistics.fmean(finals),
                final_std=std,
                steps_to_base_final=steps_to(means[name], target),
            )
        )
    return rows


def table(rows: list[dict], steps: int) -> str:
    """The summary as a markdown table."""
    lines = [
        f"| optimizer | lr | final loss (mean +- std) | steps to {BASE}'s final loss |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        reached = row["steps_to_base_final"]
        reached = f"not in {steps}" if reached is None else str(reached)
        lines.append(
            f"| {row['optimizer']} | {row['lr']:g} | {row['final_mean']:.4f} +- "
            f"{row['final_std']:.4f} | {reached} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: dict, swept: dict, rows: list[dict], every: int, path: Path) -> None:
    """The mean curves with the seeds' band and the sweep (optimizer -> lr -> final loss), on
    one figure at path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 9))
    for i, row in enumerate(rows):
        curves = list(runs[row["optimizer"]].values())
        mean, steps = mean_curve(curves), sorted(curves[0])
        label = f"{row['optimizer']}, lr {row['lr']:g} ({len(curves)} seeds)"
        top.plot(steps, [mean[s] for s in steps], color=f"C{i}", label=label)
        low = [min(c[s] for c in curves) for s in steps]
        high = [max(c[s] for c in curves) for s in steps]
        top.fill_between(steps, low, high, color=f"C{i}", alpha=0.2)
        if row["steps_to_base_final"] is not None:
            top.axvline(row["steps_to_base_final"], color=f"C{i}", linestyle=":")
        lrs = sorted(swept[row["optimizer"]])
        losses = [swept[row["optimizer"]][lr] for lr in lrs]
        bottom.plot(lrs, losses, "o-", color=f"C{i}", label=row["optimizer"])
    base = next(row for row in rows if row["optimizer"] == BASE)
    top.axhline(base["final_mean"], color="grey", linestyle="--", label=f"{BASE}'s final loss")
    top.set_ylim(top=min(4.0, top.get_ylim()[1]))
    top.set_ylabel(f"training loss (mean of {every} steps and the seeds)")
    top.set_xlabel("step")
    top.legend()
    bottom.set_xscale("log")
    bottom.set_xlabel("peak lr (sweep: one seed, fewer steps)")
    bottom.set_ylabel("final training loss")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3, help="runs per optimizer at its best lr")
    parser.add_argument("--adamw-lr", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon-lr", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2, 3e-2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--out", default="muon_quality", help="directory of the runs")
    parser.add_argument("--figures", default="docs", help="directory of the JSON and the plot")
    parser.add_argument("--reuse", action="store_true", help="keep runs already complete")
    return parser.parse_args()


def main() -> None:
    args = parse()
    out, figures = Path(args.out).resolve(), Path(args.figures).resolve()
    start = time.perf_counter()
    swept = sweep(args, out)
    best = {name: min(lrs, key=lrs.get) for name, lrs in swept.items()}
    for name, lrs in swept.items():
        finals = ", ".join(f"lr {lr:g}: {loss:.4f}" for lr, loss in lrs.items())
        print(f"sweep {name} ({args.sweep_steps} steps): {finals}; best {best[name]:g}")
    runs = seed_runs(args, out, best)
    means = {name: mean_curve(list(curves.values())) for name, curves in runs.items()}
    print("step  " + "  ".join(f"{name:>8}" for name in means))
    for step in sorted(means[BASE]):
        print(f"{step:4d}  " + "  ".join(f"{curve[step]:8.4f}" for curve in means.values()))
    rows = summary(runs, best)
    text = table(rows, args.steps)
    print(text, end="")
    (out / "table.md").write_text(text)
    seconds = time.perf_counter() - start
    command = "python scripts/muon_quality.py " + " ".join(sys.argv[1:])
    record = dict(command=command.strip(), host=host(), seconds=round(seconds), summary=rows)
    record.update(sweep={n: {f"{lr:g}": v for lr, v in s.items()} for n, s in swept.items()})
    record.update(steps=args.steps, sweep_steps=args.sweep_steps, every=args.every, curves=runs)
    figures.mkdir(parents=True, exist_ok=True)
    (figures / "muon-quality.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(runs, swept, rows, args.every, figures / "muon-quality.png")
    print(f"{host()}: {seconds:.0f} s; {figures / 'muon-quality.json'}, muon-quality.png")


if __name__ == "__main__":
    main()
