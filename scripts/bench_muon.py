"""Muon's optimizer step on CPU beside torch.optim.Muon on the same matrices, one process at
tp 1, and the arithmetic of the two ways to run Muon under ZeRO (docs/training.md, Muon).

    python scripts/bench_muon.py [--config configs/tiny.yaml] [--set KEY=VALUE ...]
                                 [--repeats 5] [--zero-config configs/llama-1b.yaml] [--dp 8]

The step: the model of --config with --set (default: a Llama of 4 blocks, d_model 256, 8
heads over 2 kv groups, d_ff 768; fp32, random gradients) and our Muon
(optim.name muon: the blocks' matrices, fused q, k and v apart, AdamW the rest) against
torch.optim.Muon on the same logical matrices (q, k, v, proj, gate, up, down as separate
tensors, as transformers stores them) plus torch.optim.AdamW (fused) on the rest: the best of
--repeats steps each, and the ratio ours / torch's; then the same model at tp 2 on two gloo
ranks of this host: its step, and the bf16 all-gathers of its split matrices alone.

The ZeRO arithmetic, per step and dp rank of the model of --zero-config at --dp: Distributed
Muon (Moonlight: each matrix's momentum shards all-gathered in bf16 over dp, Newton-Schulz on
every rank for every matrix, each keeping its shard of the result) against the layer-wise one
(Megatron: whole matrices dealt to the dp ranks, each orthogonalizing its own; as built, their
gradients all-reduced and the updated matrices broadcast by their owners): bytes sent, the
buffer a rank holds for the gathered matrices, and Newton-Schulz FLOPs. Prints a table and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatronish.accounting.muon import stage_matrices, step_flops
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.optim.muon import gather_whole
from megatronish.optim.registry import optimizer_named

LLAMA = [
    "model.arch=llama",
    "model.n_layer=4",
    "model.d_model=256",
    "model.n_head=8",
    "model.n_kv_head=2",
    "model.d_ff=768",
    "model.vocab_size=257",
]
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.sequence_parallel=false"]


def _best(step, repeats: int) -> float:
    step()  # the state's first allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def step_times(config: str, sets: list[str], repeats: int) -> dict:
    """Seconds of one optimizer step, ours and torch.optim's, on the same model's matrices."""
    cfg = load_config(config, ["optim.name=muon", "optim.zero=0", *SINGLE, *sets])
    derived = derive(cfg, 1, vocab_size=cfg.model.vocab_size or 32000)
    model = GPT(cfg, derived, ParallelState.single())
    optim = optimizer_named("muon")
    groups = optim.param_groups(model, cfg.train.weight_decay)
    ours = optim.build(groups, cfg)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    matrices = groups[0]["matrices"]
    separate = [torch.nn.Parameter(m.local(m.param).clone()) for m in matrices]
    for tensor, matrix in zip(separate, matrices):
        tensor.grad = matrix.local(matrix.param.grad).clone()
    rest = [p for g in groups[1:] for p in g["params"]]
    muon = torch.optim.Muon(separate, lr=cfg.train.lr, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=cfg.train.lr, fused=True)

    def theirs() -> None:
        muon.step()
        adamw.step()

    return {
        "matrices": len(matrices),
        "muon_elements": sum(t.numel() for t in separate),
        "ours_s": _best(ours.step, repeats),
        "torch_s": _best(theirs, repeats),
    }


def _tp2_rank(rank: int, port: int, config: str, sets: list[str], repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps = ParallelState.from_world(2, 1)
    cfg = load_config(config, ["optim.name=muon", "optim.zero=0", *SINGLE, *sets, "parallel.tp=2"])
    model = GPT(cfg, derive(cfg, 2, vocab_size=cfg.model.vocab_size or 32000), ps)
    optim = optimizer_named("muon")
    groups = optim.param_groups(model, cfg.train.weight_decay)
    update = optim.build(groups, cfg)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    blocks = [(m.local(m.param.detach()).bfloat16(), m.split_dim) for m in groups[0]["matrices"]]

    def gathers() -> None:
        for block, split_dim in blocks:
            gather_whole(block, split_dim, ps.tp_group)

    step_s, gather_s = _best(update.step, repeats), _best(gathers, repeats)
    sent = sum(2 * b.numel() for b, d in blocks if d is not None)  # its blocks, bf16
    out.put((rank, step_s, gather_s, sent))
    dist.destroy_process_group()


def tp2_times(config: str, sets: list[str], repeats: int) -> dict:
    """The optimizer step at tp 2 (two gloo ranks on this host, one thread each) and the bf16
    all-gathers of its matrices alone: seconds (the slower rank's) and the bytes a rank sends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    ranks = [
        context.Process(target=_tp2_rank, args=(r, port, config, sets, repeats, out))
        for r in range(2)
    ]
    for process in ranks:
        process.start()
    results = [out.get(timeout=600) for _ in ranks]
    for process in ranks:
        process.join()
    return {
        "tp2_step_s": max(r[1] for r in results),
        "tp2_gather_s": max(r[2] for r in results),
        "tp2_sent_bytes": results[0][3],
    }


def zero_arithmetic(config: str, dp: int) -> dict:
    """Per step and dp rank: Distributed Muon's and the layer-wise optimizer's bytes sent,
    gathered-matrix buffer and Newton-Schulz FLOPs (ZeRO-1, pp 1, tp 1)."""
    cfg = load_config(config, ["optim.name=muon", "optim.zero=0", *SINGLE, f"parallel.dp={dp}"])
    derived = derive(cfg, dp, vocab_size=cfg.model.vocab_size or 32000)
    matrices = stage_matrices(cfg, derived, 0)
    elements = sum(m.count * m.rows * m.cols for m in matrices)
    largest = max(m.rows * m.cols for m in matrices)
    flops = step_flops(cfg, matrices)
    share = (dp - 1) / dp
    return {
        "dp": dp,
        "zero_muon_elements": elements,
        # every matrix's bf16 momentum all-gathered; the ZeRO-1 parameter gather as for AdamW
        "distributed_extra_bytes_sent": 2 * elements * share,
        "distributed_buffer_bytes": 2 * largest,  # one matrix gathered at a time
        "distributed_ns_flops": flops,
        # whole matrices per rank, as built (data_parallel.zero1): the matrices' fp32 gradients
        # all-reduced and the owners' broadcasts in place of ZeRO-1's reduce-scatter and
        # all-gather, one more fp32 gradient pass; NS on 1/dp of the matrices
        "layerwise_extra_bytes_sent": 4 * elements * share,
        "layerwise_buffer_bytes": 4 * largest,  # the fp32 momentum of a whole matrix at most
        "layerwise_ns_flops": flops / dp,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--set", dest="sets", action="append", default=None)
    parser.add_argument("--zero-config", default="configs/llama-1b.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sets = LLAMA if args.sets is None else args.sets
    steps = step_times(args.config, sets, args.repeats)
    tp2 = tp2_times(args.config, sets, args.repeats)
    zero = zero_arithmetic(args.zero_config, args.dp)
    print(f"{args.config} {' '.join(sets)}, {torch.get_num_threads()} threads:")
    print(f"  {steps['matrices']} Muon matrices, {steps['muon_elements']:,} elements")
    print(f"  optimizer step: ours {steps['ours_s']:.3f} s, torch.optim {steps['torch_s']:.3f} s,")
    print(f"  ratio {steps['ours_s'] / steps['torch_s']:.2f}")
    print(
        f"  at tp 2 (2 ranks): step {tp2['tp2_step_s']:.3f} s; the bf16 all-gathers (each rank "
        f"sending {tp2['tp2_sent_bytes'] / 2**20:.1f} MiB) take {tp2['tp2_gather_s']:.3f} s alone"
    )
    print(f"{args.zero_config}, ZeRO-1 at dp {args.dp}, per step and rank:")
    for way in ("distributed", "layerwise"):
        sent, buffer = zero[f"{way}_extra_bytes_sent"], zero[f"{way}_buffer_bytes"]
        print(
            f"  {way:12s} sends {sent / 2**20:9.1f} MiB beyond ZeRO-1's, holds "
            f"{buffer / 2**20:6.1f} MiB gathered, Newton-Schulz {zero[f'{way}_ns_flops']:.3e} FLOP"
        )
    print(json.dumps({**steps, **tp2, **zero, "ratio": steps["ours_s"] / steps["torch_s"]}))


if __name__ == "__main__":
    main()
