"""Saved activation bytes per rank under context parallelism, measured next to plan's estimate.

    python scripts/bench_context.py [--seq-len 4096] [--cp 1 2 4] [--arch gpt2]

For each cp, runs cp gloo processes (one thread each) that build the same small model at
seq_len tokens, micro-batch 1, fp32, and run one forward of the loss (each rank on its zigzag
shard of the same random tokens) with megatronish.pipeline.runner.SavedTensorMeter counting the
bytes of the tensors autograd keeps for backward (parameters excluded), then the backward. Printed
per cp: the largest rank's measured bytes, plan's estimate for the same layout (Korthikanti's
per-layer formula at seq_len / cp, fp32, plus the logits and softmax), their ratio, the
measured reduction against cp = 1, the attention FLOPs every rank counted in the ring blocks,
and the seconds of the forward and backward.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 257


def model_sets(arch: str, seq_len: int, cp: int) -> list[str]:
    sets = [
        f"model.arch={arch}",
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=4",
        f"model.max_seq_len={seq_len}",
        f"model.vocab_size={VOCAB}",
        f"train.seq_len={seq_len}",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        f"parallel.cp={cp}",
    ]
    return sets + (["model.n_kv_head=2"] if arch == "llama" else [])


def _rank(rank: int, cp: int, port: int, arch: str, seq_len: int, out) -> None:
    from megatronish.config import derive, load_config
    from megatronish.context import RingCounter, shard_sequence
    from megatronish.distributed.layout import ParallelState
    from megatronish.model import GPT
    from megatronish.objectives.registry import sequence_losses
    from megatronish.pipeline.runner import SavedTensorMeter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if cp > 1:
        dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=timedelta(seconds=600))
        ps = ParallelState.from_world(1, 1, 1, cp=cp)
    else:
        ps = ParallelState.single()
    cfg = load_config(None, model_sets(arch, seq_len, cp))
    torch.manual_seed(0)
    model = GPT(cfg, derive(cfg, cp, vocab_size=VOCAB), ps)
    tokens = torch.randint(0, VOCAB, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs = shard_sequence(tokens[:, :-1], cp, ps.cp_rank)
    targets = shard_sequence(tokens[:, 1:], cp, ps.cp_rank)
    meter = SavedTensorMeter(model.parameters())
    start = time.perf_counter()
    with meter.hooks(), RingCounter() as work:
        loss = sequence_losses(model, inputs, targets).total
    loss.backward()
    seconds = time.perf_counter() - start
    out.put((rank, meter.peak, work.flops, seconds))
    if dist.is_initialized():
        dist.destroy_process_group()


def measure(arch: str, seq_len: int, cp: int) -> list[tuple[int, int, int, float]]:
    """(rank, peak saved bytes, attention FLOPs counted in ring blocks, seconds) per rank."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        context.Process(target=_rank, args=(r, cp, port, arch, seq_len, queue)) for r in range(cp)
    ]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join()
    return results


def plan_bytes(arch: str, seq_len: int, cp: int) -> float:
    """plan's activation estimate for this layout: every layer plus the logits and softmax."""
    from megatronish.accounting.memory import activation_bytes_per_layer
    from megatronish.config import derive, load_config

    cfg = load_config(None, model_sets(arch, seq_len, cp))
    d = derive(cfg, cp, vocab_size=VOCAB)
    logits = seq_len // cp * d.padded_vocab_size * 6
    return activation_bytes_per_layer(cfg, 1, False, "none") * cfg.model.n_layer + logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    args = parser.parse_args()
    print(
        f"{args.arch}, 2 layers, d_model 64, 4 heads, seq {args.seq_len}, micro-batch 1, fp32; "
        "saved activation bytes of the largest rank"
    )
    print()
    print("| cp | tokens per rank | measured MiB | plan MiB | measured / plan | cp=1 / this "
          "| attention GFLOP per rank (ring) | fwd+bwd s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for cp in args.cp:
        results = measure(args.arch, args.seq_len, cp)
        peak = max(r[1] for r in results)
        base = base if base is not None else peak
        flops = sorted({r[2] for r in results})
        flops_text = "-" if cp == 1 else " = ".join(f"{f / 1e9:.3f}" for f in flops)
        if cp > 1 and len(flops) == 1:
            flops_text += " (all ranks)"
        estimate = plan_bytes(args.arch, args.seq_len, cp)
        print(
            f"| {cp} | {args.seq_len // cp} | {peak / 2**20:.1f} | {estimate / 2**20:.1f} | "
            f"{peak / estimate:.2f} | {base / peak:.2f}x | {flops_text} | "
            f"{max(r[3] for r in results):.2f} |"
        )


if __name__ == "__main__":
    main()
