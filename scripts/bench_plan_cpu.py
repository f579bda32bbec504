"""plan's step-time model against this machine: calibrates the host (`plan --device cpu`:
matmul, attention and memory rates, op overhead, shared-memory and gloo latency and bandwidth),
predicts the step time of a small gpt2 at tp 1, tp 2, dp 2 and pp 2 on 2 cores, then trains
each layout briefly with `megatronish bench` and prints predicted against measured.

    python scripts/bench_plan_cpu.py [--steps 8] [--calibration FILE] [--repeats 1]

The model: gpt2, 4 layers, d_model 256, 4 heads, sequence 256, micro-batch 8, global batch
16, fp32, no dropout, the built-in byte-level corpus (vocab 257). One process with 2 threads
at tp 1; two processes with 1 thread each otherwise (as `bench` runs them). Each repeat runs
every layout once, in turn; the table gives the median step of the runs and the best step (the
calibration is a best-of too: a core taken by another process only makes a trial slower). A
benchmark: it prints, it does not assert; other load on the machine shifts the measured times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "tiny.yaml")
MODEL = [
    "model.d_model=256", "model.n_head=4", "model.max_seq_len=256", "model.vocab_size=257",
    "train.seq_len=256", "train.micro_batch_size=8", "train.global_batch_size=16",
    "train.precision=fp32", "model.dropout=0.0",
]  # fmt: skip
LAYOUTS = {
    "tp1": ("tp=1", []),
    "tp2": ("tp=2", ["parallel.tp=2"]),
    "dp2": ("dp=2", ["parallel.dp=2"]),
    "pp2": ("pp=2", ["parallel.pp=2"]),
}


def predicted(layout: str, calibration: str) -> dict:
    from megatronish.commands.plan import plan
    from megatronish.config import load_config

    world = 1 if layout == "tp=1" else 2
    cfg = load_config(CONFIG, MODEL)
    return json.loads(plan(cfg, world, None, None, layout, True, "cpu", calibration))


def main() -> None:
    from megatronish.commands.bench import bench_in_subprocess
    from megatronish.commands.calibrate import load_or_measure

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--calibration", default=None, help="JSON to reuse (else measured)")
    args = parser.parse_args()
    calibration = args.calibration or str(Path(tempfile.mkdtemp()) / "calibration.json")
    cal = load_or_measure(calibration)
    one = cal["threads"]["1"]
    print(f"calibration ({calibration}): {one['matmul_flops'] / 1e9:.1f} GFLOP/s fp32 matmul "
          f"at 1 thread, {cal['threads'][str(cal['cores'])]['matmul_flops'] / 1e9:.1f} at "
          f"{cal['cores']}; memory {one['memory_bytes_s'] / 1e9:.1f} GB/s; shared-memory "
          f"all-reduce {cal['shm_latency_s'] * 1e6:.0f} us + {cal['shm_bytes_s'] / 1e9:.2f} "
          f"GB/s; gloo send {cal['gloo_latency_s'] * 1e6:.0f} us + "
          f"{cal['gloo_bytes_s'] / 1e9:.2f} GB/s")  # fmt: skip
    guesses = {name: predicted(layout, calibration) for name, (layout, _) in LAYOUTS.items()}
    medians, bests = {name: [] for name in LAYOUTS}, {name: [] for name in LAYOUTS}
    for _ in range(args.repeats):  # interleaved: each repeat runs every layout once, in turn
        for name, (_, sets) in LAYOUTS.items():
            record = bench_in_subprocess(CONFIG, args.steps, MODEL + sets)
            medians[name].append(record["step_time_s"])
            bests[name].append(record["step_time_min_s"])
    print(f"load average after the runs: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print()
    print("| layout | predicted ms | measured ms (median step) | error | measured ms (best step) "
          "| error | predicted breakdown (ms) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, guess in guesses.items():
        step = guess["step_time_s"]
        median, best = statistics.median(medians[name]), min(bests[name])
        parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in guess["breakdown"].items() if v > 0)
        print(f"| {name} | {1e3 * step:.1f} | {1e3 * median:.1f} | "
              f"{100 * (step - median) / median:+.1f}% | {1e3 * best:.1f} | "
              f"{100 * (step - best) / best:+.1f}% | {parts} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
