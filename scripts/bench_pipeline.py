"""The pipeline bubble on this CPU, measured next to (p - 1) / m.

    python scripts/bench_pipeline.py [--pp 2] [--micro-batches 1 2 4 8] [--steps 5]

Runs pp gloo processes (one thread each) training a small gpt2 with both schedules, for each
number of micro-batches m per step. Each stage times its own compute (forward and backward)
and the whole schedule (the step less gradient reduction and the optimizer). The bubble is
measured on the busiest stage: schedule time over its compute time, minus 1 (the time it sits
idle, as a fraction of the ideal), which the theory puts at (p - 1) / m when the stages take
equal time and sending costs nothing. Also printed: the most
micro-batches of activations a stage held (1F1B: at most pp; GPipe: m).
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

MODEL = [
    "model.arch=gpt2",
    "model.n_layer=4",
    "model.d_model=128",
    "model.n_head=4",
    "model.max_seq_len=128",
    "train.seq_len=128",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "checkpoint.save=false",
]


def _rank(rank: int, pp: int, port: int, cases, steps: int, dataset: str, out) -> None:
    from megatronish.config import derive, load_config
    from megatronish.data import dataset_vocab_size
    from megatronish.parallel import ParallelState
    from megatronish.trainer import Setup, Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=pp, timeout=timedelta(seconds=300))
    ps = ParallelState.from_world(1, 1, pp)
    results = []
    for schedule, m in cases:
        sets = MODEL + [
            f"parallel.pp={pp}",
            f"parallel.pp_schedule={schedule}",
            f"train.global_batch_size={2 * m}",
            f"train.steps={steps + 2}",
            f"data.path={dataset}",
        ]
        cfg = load_config(None, sets)
        derived = derive(cfg, pp, vocab_size=dataset_vocab_size(Path(dataset)))
        trainer = Trainer(Setup(cfg, derived, ps, Path(dataset)))
        for _ in range(2):
            trainer.train_step()
        step_times, compute, held = [], [], 0
        for _ in range(steps):
            dist.barrier()
            trainer.train_step()
            stats = trainer.pipeline.stats
            step_times.append(stats.total_s)
            compute.append(stats.compute_s)
            held = max(held, stats.max_in_flight)
        results.append((statistics.median(step_times), statistics.median(compute), held))
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from megatronish.data import prepare_dataset

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(3000)))
        dataset = prepare_dataset([str(corpus)], str(Path(tmp) / "ds"), val_fraction=0.0)
        cases = [(s, m) for s in ("1f1b", "gpipe") for m in args.micro_batches]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [
            ctx.Process(
                target=_rank, args=(r, args.pp, port, cases, args.steps, str(dataset), queue)
            )
            for r in range(args.pp)
        ]
        for proc in procs:
            proc.start()
        per_rank = dict(queue.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join(timeout=30)
    print(f"pp {args.pp}, gpt2 4 layers d_model 128, micro-batch 2 x seq 128, 1 thread per stage")
    print(f"{'schedule':>8} {'m':>3} {'sched s':>8} {'(p-1)/m':>8} {'measured':>9} {'held':>5}")
    for index, (schedule, m) in enumerate(cases):
        step = max(per_rank[r][index][0] for r in range(args.pp))
        busiest = max(per_rank[r][index][1] for r in range(args.pp))
        held = max(per_rank[r][index][2] for r in range(args.pp))
        theory = (args.pp - 1) / m
        print(
            f"{schedule:>8} {m:>3} {step:>8.3f} {theory:>8.3f} {step / busiest - 1:>9.3f} {held:>5}"
        )


if __name__ == "__main__":
    main()
