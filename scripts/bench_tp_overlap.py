"""Step time, exposed tensor-parallel wait and bytes at tp = 2 with the tp collectives
decomposed under the GEMMs (parallel.tp_comm_overlap) and without, with and without sequence
parallelism.

    python scripts/bench_tp_overlap.py [--rounds 5] [--steps 6] [--gloo]

Runs `megatronish bench` on a config whose tensor-parallel traffic is large next to its
compute (gpt2, 4 layers, d_model 512, seq 256, micro-batch 2, one micro-batch a step: each
activation collective moves 1 MB) with the overlap on and off, interleaved `rounds` times, one
core a rank. Prints a markdown table of the medians: step time, rank 0's exposed wait in
tensor-parallel communication per step (the phase timers: the time it was blocked in tp
collectives and ring hops), that wait's share of the step, and the bytes a rank sends per step
(all of them, and those of the ring hops); then the ratios on / off. The ranks' tp group runs
through shared memory (whose transfer is a copy the waiting rank makes itself, so the overlap
can hide only the other rank's lateness) unless --gloo (plain gloo over loopback TCP, whose
transfers run on gloo's own threads, beside the GEMMs).
"""

from __future__ import annotations

import argparse
import statistics

from megatronish.commands.bench import bench_in_subprocess

MODEL = [
    "parallel.tp=2", "model.arch=gpt2", "model.n_layer=4", "model.d_model=512",
    "model.n_head=8", "model.max_seq_len=256", "train.seq_len=256", "train.micro_batch_size=2",
    "train.global_batch_size=2",
]  # fmt: skip
SP = ["parallel.sequence_parallel=true"]
VARIANTS = {
    "tp2 sp, overlap off": SP + ["parallel.tp_comm_overlap=false"],
    "tp2 sp, overlap on": SP + ["parallel.tp_comm_overlap=true"],
    "tp2, overlap off": ["parallel.tp_comm_overlap=false"],
    "tp2, overlap on": ["parallel.tp_comm_overlap=true"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gloo", action="store_true")
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1", **({"MEGATRONISH_SHM": "0"} if args.gloo else {})}
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, sets in VARIANTS.items():
            runs[name].append(bench_in_subprocess(args.config, args.steps, MODEL + sets, env))
    transport = "gloo (loopback TCP)" if args.gloo else "shared memory"
    print(f"tp 2 on this machine, {transport}; medians of {args.rounds} interleaved runs")
    print("| variant | step time ms | exposed tp wait ms | share of step | sent MB | ring MB |")
    print("|---|---|---|---|---|---|")
    steps, waits = {}, {}
    for name, records in runs.items():
        step = steps[name] = statistics.median(r["step_time_s"] for r in records)
        wait = waits[name] = statistics.median(r["exposed_tp_wait_s"] for r in records)
        sent, ring = records[0]["bytes_sent_per_step"], records[0]["tp_ring_bytes_per_step"]
        print(
            f"| {name} | {step * 1e3:.1f} | {wait * 1e3:.1f} | {100 * wait / step:.1f}% | "
            f"{sent / 1e6:.2f} | {ring / 1e6:.2f} |"
        )
    print()
    for label in ("tp2 sp", "tp2"):
        on, off = f"{label}, overlap on", f"{label}, overlap off"
        print(
            f"{label}: with the overlap / without: step time {steps[on] / steps[off]:.2f}, "
            f"exposed tp wait {waits[on] / waits[off]:.2f}"
        )


if __name__ == "__main__":
    main()
