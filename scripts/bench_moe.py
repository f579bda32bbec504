"""Tokens/s and memory per rank of the tiny MoE config (configs/tiny-moe.yaml) with its
experts on every rank (ep = 1) and split over two ranks (ep = 2), both at dp = 2 on CPU.

    python scripts/bench_moe.py [--steps 6]

Each layout runs `megatronish bench` (two gloo processes, one thread each) and reads its JSON
line: tokens/s and step time, and the peak resident memory above the start of the largest
rank; the all-to-all bytes a rank sends per step are the analytic count (bench prints the
measured bytes next to it). The parameter columns count what one rank holds
(all its parameters, and the expert weights among them); with AdamW in fp32 each parameter
costs 16 bytes of weights, gradient and optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny-moe.yaml"


def rank_parameters(ep: int) -> tuple[int, int, float]:
    """(parameters, expert parameters) that one rank holds at dp = 2 and this ep, and the
    all-to-all bytes it sends per step by the analytic count."""
    from megatronish.accounting.collectives import collectives_per_step
    from megatronish.config import derive, load_config
    from megatronish.distributed.layout import ParallelState
    from megatronish.model import GPT
    from megatronish.moe import is_expert

    cfg = load_config(CONFIG, ["parallel.dp=2", f"parallel.ep={ep}", "model.vocab_size=257"])
    derived = derive(cfg, 2)
    params = list(GPT(cfg, derived, ParallelState.single()).parameters())
    sent = sum(op.sent for op in collectives_per_step(cfg, derived) if op.kind == "all_to_all")
    return sum(p.numel() for p in params), sum(p.numel() for p in params if is_expert(p)), sent


def bench(ep: int, steps: int) -> dict:
    command = [
        sys.executable, "-m", "megatronish", "bench", "--config", str(CONFIG),
        "--steps", str(steps), "--set", "parallel.dp=2", "--set", f"parallel.ep={ep}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"bench at ep={ep} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"configs/tiny-moe.yaml at dp = 2 on CPU (2 ranks, one thread each), {args.steps} steps")
    print()
    print("| ep | tokens/s | step s | params per rank | expert params per rank | "
          "weights+grads+AdamW MiB per rank | peak memory above start MiB | "
          "all-to-all MiB sent per step (analytic) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    for ep in (1, 2):
        record = bench(ep, args.steps)
        params, experts, sent = rank_parameters(ep)
        rows[ep] = dict(record, params=params, expert_params=experts)
        print(
            f"| {ep} | {record['tokens_per_s']:.0f} | {record['step_time_s']:.3f} | {params:,} | "
            f"{experts:,} | {16 * params / 2**20:.1f} | "
            f"{1024 * record['peak_memory_above_start_gb']:.0f} | {sent / 2**20:.2f} |"
        )
    print()
    ratio = rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"]
    print(f"ep=2 / ep=1 tokens/s: {ratio:.2f}; expert parameters per rank "
          f"{rows[1]['expert_params'] / rows[2]['expert_params']:.2f}x fewer at ep=2")  # fmt: skip


if __name__ == "__main__":
    main()
