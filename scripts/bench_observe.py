"""What observability costs: step time with phase times and the flight recorder on (the
default) against both off, and the bookkeeping every collective pays either way.

    python scripts/bench_observe.py [--config configs/tiny-tp2.yaml] [--rounds 3] [--steps 20]

Runs `megatronish bench` on the config in alternation, `rounds` times each way (interleaved,
because timings on a shared machine drift), and prints each run's median step time, the
median of each variant and their ratio. Then times the flight recorder's begin/end pair that
every collective runs even when both are off, and puts it against the collectives per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatronish.commands.bench import bench_in_subprocess as bench

OFF = ["observe.phase_times=false", "observe.flight_recorder=0"]


def bookkeeping_seconds(calls: int = 20000) -> float:
    """Seconds of one RECORDER.begin + end pair (the recorder keeping 2000 entries)."""
    from megatronish.observe.record import RECORDER

    tensor = torch.empty(8)
    start = time.perf_counter()
    for _ in range(calls):
        entry = RECORDER.begin("all_reduce", None, tensor)
        RECORDER.end(entry, entry.start)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-tp2.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"on": [], "off": []}
    calls = 0.0
    for round_ in range(args.rounds):
        for name, sets in (("on", []), ("off", OFF)):
            record = bench(args.config, args.steps, sets)
            times[name].append(record["step_time_s"])
            calls = record["comm_calls_per_step"]
            print(f"round {round_ + 1} {name:>3}: step {record['step_time_s'] * 1e3:.2f} ms")
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"median step time: on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, on/off {on / off:.3f}")
    pair = bookkeeping_seconds()
    print(
        f"recorder bookkeeping: {pair * 1e6:.2f} us per collective x {calls:.0f} collectives per "
        f"step = {pair * calls * 1e3:.3f} ms, {100 * pair * calls / off:.2f}% of the step"
    )


if __name__ == "__main__":
    main()
