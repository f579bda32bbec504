"""The pipeline bubble on this CPU, measured next to (p - 1) / (v m).

    python scripts/bench_pipeline.py [--pp 2 4] [--virtual 1 2] [--micro-batches 4 8]
                                     [--schedules 1f1b gpipe] [--steps 5]
                                     [--d-model 256] [--micro-batch-size 4]

For each pipeline degree p, runs p gloo processes (one thread each) training a small gpt2 (8
layers, so that every rank can hold 2 chunks at p = 4) under each schedule, number of model
chunks per rank v (parallel.pp_virtual; v > 1 only where m is a multiple of p) and number of
micro-batches m per step. Each stage times its own compute (forward and backward) and the
whole schedule (the step less gradient reduction and the optimizer). The bubble is measured on
the busiest stage: schedule time over its compute time, minus 1 (the time it sits idle, as a
fraction of the ideal), which the theory puts at (p - 1) / (v m) when the stages take equal
time and sending costs nothing. Also printed: the most (micro-batch, chunk) pairs of
activations a stage held (1F1B at v = 1: at most p; GPipe: m v).

Sending is not free here: a gloo message between busy processes takes about a millisecond or
more, and interleaving sends v times as many. The default model (d_model 256, micro-batches of
4 sequences of 128) keeps a chunk's forward well above that; at d_model 128 and micro-batches
of 2 a 2-layer chunk's forward takes a few milliseconds and the extra messages eat much of the
gain. With more processes than cores (p = 4 on 2 cores) the stages share the cores: compute is
timed on the wall clock, slowed where stages overlap, so the measured bubble is the time a
stage waits for its neighbours relative to its own (slowed) compute, and the step itself can
get no shorter than all the stages' compute over the cores, whatever v.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N_LAYER = 8
MODEL = [
    "model.arch=gpt2",
    f"model.n_layer={N_LAYER}",
    "model.n_head=4",
    "model.max_seq_len=128",
    "train.seq_len=128",
    "train.eval_every=0",
    "checkpoint.save=false",
]


def _rank(rank: int, pp: int, port: int, cases, args, dataset: str, out) -> None:
    """One stage of every case (schedule, v, m): its median schedule and compute seconds and
    the most activations it held."""
    from megatronish.config import derive, load_config
    from megatronish.data.sources import run_data
    from megatronish.distributed.layout import ParallelState
    from megatronish.training.setup import Setup
    from megatronish.training.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=pp, timeout=timedelta(seconds=300))
    ps = ParallelState.from_world(1, 1, pp)
    results = []
    for schedule, virtual, m in cases:
        sets = MODEL + [
            f"model.d_model={args.d_model}",
            f"train.micro_batch_size={args.micro_batch_size}",
            f"parallel.pp={pp}",
            f"parallel.pp_virtual={virtual}",
            f"parallel.pp_schedule={schedule}",
            f"train.global_batch_size={args.micro_batch_size * m}",
            f"train.steps={args.steps + 2}",
            f"data.path={dataset}",
        ]
        cfg = load_config(None, sets)
        cfg, data = run_data(cfg)
        derived = derive(cfg, pp, vocab_size=data.vocab_size)
        trainer = Trainer(Setup(cfg, derived, ps, data))
        for _ in range(2):
            trainer.train_step()
        step_times, compute, held = [], [], 0
        for _ in range(args.steps):
            dist.barrier()
            trainer.train_step()
            stats = trainer.pipeline.stats
            step_times.append(stats.total_s)
            compute.append(stats.compute_s)
            held = max(held, stats.max_in_flight)
        results.append((statistics.median(step_times), statistics.median(compute), held))
    out.put((rank, results))
    dist.destroy_process_group()


def run_stages(pp: int, cases, args, dataset: str) -> dict[int, list]:
    """Every stage's results of the cases, by pp rank (pp processes, spawned)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, pp, port, cases, args, dataset, queue))
        for r in range(pp)
    ]
    for proc in procs:
        proc.start()
    per_rank = dict(queue.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    return per_rank


def cases_for(pp: int, args) -> list[tuple[str, int, int]]:
    """(schedule, v, m) for pp: v > 1 where m is a multiple of pp and every chunk has a layer."""
    return [
        (schedule, virtual, m)
        for schedule in args.schedules
        for virtual in args.virtual
        for m in args.micro_batches
        if virtual == 1 or (m % pp == 0 and pp * virtual <= N_LAYER)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--virtual", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    args = parser.parse_args()
    from megatronish.data import prepare_dataset

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(3000)))
        dataset = prepare_dataset([str(corpus)], str(Path(tmp) / "ds"), val_fraction=0.0)
        for pp in args.pp:
            cases = cases_for(pp, args)
            per_rank = run_stages(pp, cases, args, str(dataset))
            for index, case in enumerate(cases):
                stages = [per_rank[r][index] for r in range(pp)]
                rows.append((pp, *case, *_measured(stages)))
    print(
        f"gpt2 {N_LAYER} layers d_model {args.d_model}, micro-batch {args.micro_batch_size} x "
        f"seq 128, 1 thread per stage, {os.cpu_count()} cores"
    )
    print(
        f"{'pp':>3} {'schedule':>8} {'v':>2} {'m':>3} {'sched s':>8} {'(p-1)/vm':>9} "
        f"{'measured':>9} {'held':>5}"
    )
    for pp, schedule, virtual, m, step, bubble, held in rows:
        theory = (pp - 1) / (virtual * m)
        print(
            f"{pp:>3} {schedule:>8} {virtual:>2} {m:>3} {step:>8.3f} {theory:>9.3f} "
            f"{bubble:>9.3f} {held:>5}"
        )


def _measured(stages: list[tuple[float, float, int]]) -> tuple[float, float, int]:
    """(schedule seconds of the slowest stage, measured bubble, most activations held) of one
    case from each stage's (schedule s, compute s, held)."""
    step = max(stage[0] for stage in stages)
    busiest = max(stage[1] for stage in stages)
    return step, step / busiest - 1, max(stage[2] for stage in stages)


if __name__ == "__main__":
    main()
