"""The machinery of the training-quality runs (scripts/fp8_quality.py, scripts/muon_quality.py):
a tiny Llama trained by the CLI on the built-in corpus (data.path's default, prepared on first
use), one CPU process and one thread a run, several runs at a time; a run's curve is, at every
every-th step, its training loss averaged over the every steps up to it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny.yaml"  # its schedule and seed; the model is MODEL
MODEL = [
    "model.arch=llama",
    "model.n_layer=2",
    "model.d_model=128",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.max_seq_len=128",
]
TRAIN = [  # the learning rate is each script's own
    "train.seq_len=128",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.warmup_steps=20",
    "train.eval_every=0",
    "checkpoint.save=false",
]
FIRST_SEED = 1234
T = TypeVar("T")
R = TypeVar("R")


def train(sets: list[str], steps: int, every: int, out: Path, reuse: bool) -> dict[int, float]:
    """Every every-th step's training loss of one run, averaged over the every steps up to
    it (with reuse, from out's metrics where they hold `steps` steps, without training)."""
    if reuse and all(s in (losses := _losses(out)) for s in range(1, steps + 1)):
        return _means(losses, steps, every)
    sets = MODEL + TRAIN + sets + [f"train.steps={steps}", "train.log_every=1"]
    args = [sys.executable, "-m", "megatronish", "train", "--config", str(CONFIG)]
    args += ["--set", f"run.out_dir={out}"]
    for s in sets:
        args += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread a run, several runs side by side
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"{' '.join(sets)}: exit {result.returncode}\n{result.stderr[-2000:]}")
    return _means(_losses(out), steps, every)


def _losses(out: Path) -> dict[int, float]:
    """step -> training loss of the run in out ({} before it has run)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line and "step" in line}


def _means(losses: dict[int, float], steps: int, every: int) -> dict[int, float]:
    ends = range(every, steps + 1, every)
    return {end: sum(losses[s] for s in range(end - every + 1, end + 1)) / every for end in ends}


def mean_curve(curves: list[dict[int, float]]) -> dict[int, float]:
    """The step-by-step mean of several runs' curves."""
    return {step: sum(c[step] for c in curves) / len(curves) for step in curves[0]}


def run_all(jobs: int, run: Callable[[T], R], items: Sequence[T]) -> dict[T, R]:
    """run(item) for every item, jobs at a time."""
    with ThreadPoolExecutor(jobs) as pool:
        return dict(zip(items, pool.map(run, items)))


def run_dir(out: Path, name: str, seed: int) -> Path:
    """The directory of one run: out/<name, spaces as underscores, commas dropped>_seed<seed>."""
    return out / f"{name.replace(' ', '_').replace(',', '')}_seed{seed}"


def host() -> str:
    """The CPU's model name (/proc/cpuinfo where there is one) and the cores this process sees."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        model = names[0].split(":", 1)[1].strip() if names else model
    return f"{model}, {len(os.sched_getaffinity(0))} cores"
