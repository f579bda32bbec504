"""Exposed data-parallel communication with the gradient reduction overlapped with backward,
and without, at dp = 2 (and dp = 2 with ZeRO-1).

    python scripts/bench_overlap.py [--rounds 5] [--steps 6] [--shm]

Runs `megatronish bench` on a config whose gradients are large next to its compute (gpt2,
4 layers, d_model 512, seq 64, micro-batch 2, one micro-batch a step: 12.7 M parameters,
51 MB of fp32 gradients a step; 4 MB buckets) with optim.overlap_grad_reduce on and off,
interleaved `rounds` times. Prints a markdown table of the medians: step time, rank 0's
exposed wait in data-parallel communication per step (the phase timers: the time it was
blocked in dp collectives; with ZeRO-1 the parameter all-gathers too, which with the overlap
run during the next forward) and that wait's share of the step, then the exposed-wait ratio
on / off. The ranks use plain gloo (loopback TCP, whose transfer runs on gloo's own threads)
unless --shm (shared memory, which combines the tensors inside the wait, so the overlap only
hides the other rank's lateness).
"""

from __future__ import annotations

import argparse
import statistics

from megatronish.commands.bench import bench_in_subprocess

MODEL = [
    "parallel.dp=2", "train.micro_batch_size=2", "train.global_batch_size=4",
    "model.d_model=512", "model.n_head=8", "model.n_layer=4", "train.seq_len=64",
    "optim.bucket_mb=4",
]  # fmt: skip
VARIANTS = {
    "dp2, overlap on": ["optim.overlap_grad_reduce=true"],
    "dp2, overlap off": ["optim.overlap_grad_reduce=false"],
    "dp2 ZeRO-1, overlap on": ["optim.zero=1", "optim.overlap_grad_reduce=true"],
    "dp2 ZeRO-1, overlap off": ["optim.zero=1", "optim.overlap_grad_reduce=false"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--shm", action="store_true")
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1", **({} if args.shm else {"MEGATRONISH_SHM": "0"})}
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, sets in VARIANTS.items():
            runs[name].append(bench_in_subprocess(args.config, args.steps, MODEL + sets, env))
    print("| variant | step time ms | exposed dp wait ms | share of step |")
    print("|---|---|---|---|")
    waits = {}
    for name, records in runs.items():
        step = statistics.median(r["step_time_s"] for r in records)
        wait = waits[name] = statistics.median(r["exposed_dp_wait_s"] for r in records)
        print(f"| {name} | {step * 1e3:.1f} | {wait * 1e3:.1f} | {100 * wait / step:.1f}% |")
    print()
    for label in ("dp2", "dp2 ZeRO-1"):
        on, off = waits[f"{label}, overlap on"], waits[f"{label}, overlap off"]
        print(f"{label}: exposed wait with the overlap / without: {on / off:.2f}")


if __name__ == "__main__":
    main()
