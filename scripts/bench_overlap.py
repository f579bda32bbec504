"""Exposed data-parallel communication with the gradient reduction overlapped with backward,
and without, at dp = 2; at every ZeRO level (0 to 3, ZeRO-3's prefetch on and off); and the
cost of ZeRO-2's reduce-scatter after every micro-batch at 4 micro-batches a step.

    python scripts/bench_overlap.py [--rounds 5] [--steps 6] [--shm]

Runs `megatronish bench` on a config whose gradients are large next to its compute (gpt2,
4 layers, d_model 512, seq 64, micro-batch 2, one micro-batch a step: 12.7 M parameters,
51 MB of fp32 gradients a step; 4 MB buckets) with optim.overlap_grad_reduce on and off,
interleaved `rounds` times. Prints a markdown table of the medians: step time, rank 0's
exposed wait in data-parallel communication per step (the phase timers: the time it was
blocked in dp collectives; with ZeRO the parameter all-gathers too, which with the overlap
run during the next forward, under ZeRO-3 the modules' gathers before forward and backward),
that wait's share of the step and the bytes a rank sends per step; then the exposed-wait ratio
on / off, and ZeRO-2 against ZeRO-1 (which keeps whole gradients until the last micro-batch)
at 4 micro-batches a step. The ranks use plain gloo (loopback TCP, whose transfer runs on
gloo's own threads) unless --shm (shared memory, which combines the tensors inside the wait,
so the overlap only hides the other rank's lateness).
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
ACCUMULATE = ["train.global_batch_size=16"]  # 4 micro-batches a step
VARIANTS = {
    "dp2, overlap on": ["optim.overlap_grad_reduce=true"],
    "dp2, overlap off": ["optim.overlap_grad_reduce=false"],
    "dp2 ZeRO-1, overlap on": ["optim.zero=1", "optim.overlap_grad_reduce=true"],
    "dp2 ZeRO-1, overlap off": ["optim.zero=1", "optim.overlap_grad_reduce=false"],
    "dp2 ZeRO-2, overlap on": ["optim.zero=2"],
    "dp2 ZeRO-3, prefetch on": ["optim.zero=3", "optim.zero3_prefetch=true"],
    "dp2 ZeRO-3, prefetch off": ["optim.zero=3", "optim.zero3_prefetch=false"],
    "dp2 ZeRO-1, 4 micro-batches": ["optim.zero=1", *ACCUMULATE],
    "dp2 ZeRO-2, 4 micro-batches": ["optim.zero=2", *ACCUMULATE],
    "dp2 ZeRO-3, 4 micro-batches": ["optim.zero=3", *ACCUMULATE],
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
    print("| variant | step time ms | exposed dp wait ms | share of step | sent MB |")
    print("|---|---|---|---|---|")
    waits, steps, sent = {}, {}, {}
    for name, records in runs.items():
        step = steps[name] = statistics.median(r["step_time_s"] for r in records)
        wait = waits[name] = statistics.median(r["exposed_dp_wait_s"] for r in records)
        sent[name] = records[0]["bytes_sent_per_step"]
        print(
            f"| {name} | {step * 1e3:.1f} | {wait * 1e3:.1f} | {100 * wait / step:.1f}% | "
            f"{sent[name] / 1e6:.1f} |"
        )
    print()
    for label in ("dp2", "dp2 ZeRO-1"):
        on, off = waits[f"{label}, overlap on"], waits[f"{label}, overlap off"]
        print(f"{label}: exposed wait with the overlap / without: {on / off:.2f}")
    on, off = waits["dp2 ZeRO-3, prefetch on"], waits["dp2 ZeRO-3, prefetch off"]
    print(f"dp2 ZeRO-3: exposed wait with the prefetch / without: {on / off:.2f}")
    one, two = "dp2 ZeRO-1, 4 micro-batches", "dp2 ZeRO-2, 4 micro-batches"
    print(
        f"ZeRO-2 at 4 micro-batches a step against ZeRO-1: {sent[two] / sent[one]:.2f}x the bytes "
        f"sent, {steps[two] / steps[one]:.2f}x the step time, "
        f"{waits[two] * 1e3:.1f} vs {waits[one] * 1e3:.1f} ms exposed dp wait"
    )


if __name__ == "__main__":
    main()
