"""Muon's optimizer step on CPU beside torch.optim.Muon on the same matrices, one process at
tp 1, and the two ways to run Muon under ZeRO, measured at dp 2 and counted at scale
(docs/training.md, Muon).

    python scripts/bench_muon.py [--config configs/tiny.yaml] [--set KEY=VALUE ...]
                                 [--repeats 5] [--zero-config configs/llama-1b.yaml] [--dp 8]

The step: the model of --config with --set (default: a Llama of 4 blocks, d_model 256, 8
heads over 2 kv groups, d_ff 768; fp32, random gradients) and our Muon
(optim.name muon: the blocks' matrices, fused q, k and v apart, AdamW the rest) against
torch.optim.Muon on the same logical matrices (q, k, v, proj, gate, up, down as separate
tensors, as transformers stores them) plus torch.optim.AdamW (fused) on the rest: the best of
--repeats steps each, and the ratio ours / torch's; then the same model at tp 2 on two gloo
ranks of this host: its step, and the bf16 all-gathers of its split matrices alone.

The two ways to run Muon under ZeRO: Distributed Muon (Moonlight: each matrix's momentum
shards all-gathered in bf16 over dp, Newton-Schulz on every rank for every matrix, each keeping
its shard of the result) and the layer-wise one (Megatron: whole matrices dealt to the dp
ranks, each orthogonalizing its own; as built, their gradients reduced to their owners and the
updated matrices broadcast by them). Measured at ZeRO-1 dp 2 on two gloo ranks of this host
(one thread each) for the same model's matrices, each part the best of --repeats: the
layer-wise step as built (data_parallel.outside's reduce to the owners, the owner's Muon
update, the broadcasts), and Distributed Muon's collectives and Newton-Schulz as real calls of
its sizes (the matrices' fp32 gradients reduce-scattered, each matrix's bf16 shards
all-gathered, Newton-Schulz on each whole matrix, the fp32 parameters all-gathered; not wired
into the optimizer): seconds (the slower rank's), bytes a rank sends, momentum and gathered
buffer. Then the arithmetic per step and dp rank of the model of --zero-config at --dp: bytes
sent beyond ZeRO-1's, the buffer a rank holds for a gathered matrix, and Newton-Schulz FLOPs.
Prints the host (CPU model, cores, load), a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatronish.accounting.muon import stage_matrices, step_flops
from megatronish.config import derive, load_config
from megatronish.config.optim_checks import muon_settings
from megatronish.data_parallel.outside import reduce_gradients, zero_owners
from megatronish.distributed import comm
from megatronish.distributed.comm import CommCounter
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.optim.muon import MuonOptimizer, gather_whole, newton_schulz
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


def _on_two_ranks(target, *args) -> list:
    """target(rank, port, *args, queue) on two spawned processes of this host; what each put
    on the queue, in the order they put it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=target, args=(r, port, *args, out)) for r in range(2)]
    for process in ranks:
        process.start()
    results = [out.get(timeout=600) for _ in ranks]
    for process in ranks:
        process.join()
    return results


def tp2_times(config: str, sets: list[str], repeats: int) -> dict:
    """The optimizer step at tp 2 (two gloo ranks on this host, one thread each) and the bf16
    all-gathers of its matrices alone: seconds (the slower rank's) and the bytes a rank sends."""
    results = _on_two_ranks(_tp2_rank, config, sets, repeats)
    return {
        "tp2_step_s": max(r[1] for r in results),
        "tp2_gather_s": max(r[2] for r in results),
        "tp2_sent_bytes": results[0][3],
    }


def _zero1_rank(rank: int, port: int, config: str, sets: list[str], repeats: int, out) -> None:
    """One of two gloo ranks at ZeRO-1 dp 2: both ways' Muon step, each part timed (module
    doc), with what each way keeps and sends."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps = ParallelState.from_world(1, 2)
    cfg = load_config(config, ["optim.name=muon", "optim.zero=1", *SINGLE, *sets, "parallel.dp=2"])
    model = GPT(cfg, derive(cfg, 2, vocab_size=cfg.model.vocab_size or 32000), ps)
    muon = MuonOptimizer()
    group = muon.param_groups(model, cfg.train.weight_decay)[0]
    params, matrices = group["params"], group["matrices"]
    grads = [torch.randn_like(p) for p in params]
    owner = dict(zip(map(id, params), zero_owners(params, 2)))  # global rank = dp rank here
    mine = {id(p) for p in params if owner[id(p)] == rank}
    owned = [m for m in matrices if id(m.param) in mine]
    update = muon.build([{**group, "params": [p for p in params if id(p) in mine],
                          "matrices": owned}], cfg)  # fmt: skip
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = torch.cat([flat, flat.new_zeros(flat.numel() % 2)])  # a bucket padded to dp
    wholes = [m.local(m.param.detach()).bfloat16() for m in matrices]
    shards = [_half(w.reshape(-1), rank) for w in wholes]
    counter, other = CommCounter(), CommCounter()
    times: dict[str, list[float]] = {}
    for _ in range(repeats):  # the two ways in turn: the same load on both
        with counter:
            parts = _layerwise(params, grads, owner, update, ps)
        with other:
            parts |= _distributed(flat, shards, [w.shape for w in wholes], cfg, ps)
        for kind, seconds in parts.items():
            times.setdefault(kind, []).append(seconds)
    momentum = sum(p.numel() for p in params if id(p) in mine) * 4
    totals = {
        f"{way}_totals": [sum(p) for p in zip(*(v for k, v in times.items() if way in k))]
        for way in ("layerwise", "distributed")
    }
    out.put({
        "rank": rank, **{kind: min(seconds) for kind, seconds in times.items()}, **totals,
        "layerwise_sent_bytes": counter.total_sent / repeats,
        "layerwise_momentum_bytes": momentum,
        "distributed_sent_bytes": other.total_sent / repeats,
        "distributed_momentum_bytes": sum(t.numel() for t in shards) * 4,
        "distributed_buffer_bytes": max(2 * t.numel() for t in shards) * 2,
    })  # fmt: skip
    dist.destroy_process_group()


def _layerwise(params, grads, owner: dict, update, ps) -> dict[str, float]:
    """Seconds of the layer-wise step's parts: Muon's gradients reduced to their owners, the
    owner's update, its broadcasts."""
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    dist.barrier()
    start = time.perf_counter()
    reduce_gradients(params, ps, owners=owner)
    reduced = time.perf_counter()
    update.step()
    updated = time.perf_counter()
    for param in params:
        comm.broadcast(param.data, owner[id(param)], ps.dp_cp_group)
    marks = [start, reduced, updated, time.perf_counter()]
    kinds = ("reduce", "update", "broadcast")
    return {f"layerwise_{k}_s": b - a for k, a, b in zip(kinds, marks, marks[1:])}


def _half(flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank's half of the 1-D flat, padded to an even length (a matrix's momentum shard)."""
    return torch.cat([flat, flat.new_zeros(flat.numel() % 2)]).chunk(2)[rank]


def _distributed(flat, shards, shapes, cfg, ps) -> dict[str, float]:
    """Seconds of Distributed Muon's parts on the same matrices: their fp32 gradients
    reduce-scattered, each matrix's bf16 momentum shards all-gathered, Newton-Schulz on every
    matrix, the updated shards all-gathered (fp32)."""
    settings = muon_settings(cfg)
    sent = flat.clone()
    dist.barrier()
    start = time.perf_counter()
    comm.reduce_scatter_in_place(sent, ps.dp_cp_group)
    scattered = time.perf_counter()
    whole = []
    for shard in shards:
        gathered = shard.new_empty(2 * shard.numel())
        comm.all_gather_into(gathered, shard, ps.dp_cp_group)
        whole.append(gathered)
    gathered_at = time.perf_counter()
    for shape, full in zip(shapes, whole):
        matrix = full[: shape[0] * shape[1]].view(shape)
        newton_schulz(matrix, tuple(settings.ns_coefficients), settings.ns_steps, settings.eps)
    ns = time.perf_counter()
    comm.all_gather_in_place(sent, ps.dp_cp_group)
    marks = [start, scattered, gathered_at, ns, time.perf_counter()]
    kinds = ("scatter", "gather", "ns", "params")
    return {f"distributed_{k}_s": b - a for k, a, b in zip(kinds, marks, marks[1:])}


def zero1_dp2_times(config: str, sets: list[str], repeats: int) -> dict:
    """Both ways at ZeRO-1 dp 2 on two gloo ranks of this host (the slower rank's seconds)."""
    results = _on_two_ranks(_zero1_rank, config, sets, repeats)
    keys = [k for k in results[0] if k != "rank" and not k.endswith("_totals")]
    both = {  # each repeat's seconds of each way, the slower rank's
        way: [max(pair) for pair in zip(*(r[f"{way}_totals"] for r in results))]
        for way in ("layerwise", "distributed")
    }
    ratios = [d / w for w, d in zip(both["layerwise"], both["distributed"])]
    return {
        **{f"dp2_{k}": max(r[k] for r in results) for k in keys},
        "dp2_ratio": statistics.median(ratios),
    }


def host() -> str:
    """This host's CPU model, its cores and the load average over the last minute."""
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"


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
        # reduced to their owners and the owners' broadcasts in place of ZeRO-1's
        # reduce-scatter and all-gather, (n-1)/n each: nothing more; NS on 1/dp of the matrices
        "layerwise_extra_bytes_sent": 0,
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
    dp2 = zero1_dp2_times(args.config, sets, args.repeats)
    zero = zero_arithmetic(args.zero_config, args.dp)
    print(f"host: {host()}")
    print(f"{args.config} {' '.join(sets)}, {torch.get_num_threads()} threads:")
    print(f"  {steps['matrices']} Muon matrices, {steps['muon_elements']:,} elements")
    print(f"  optimizer step: ours {steps['ours_s']:.3f} s, torch.optim {steps['torch_s']:.3f} s,")
    print(f"  ratio {steps['ours_s'] / steps['torch_s']:.2f}")
    print(
        f"  at tp 2 (2 ranks): step {tp2['tp2_step_s']:.3f} s; the bf16 all-gathers (each rank "
        f"sending {tp2['tp2_sent_bytes'] / 2**20:.1f} MiB) take {tp2['tp2_gather_s']:.3f} s alone"
    )
    _print_dp2(dp2)
    print(f"{args.zero_config}, ZeRO-1 at dp {args.dp}, per step and rank:")
    for way in ("distributed", "layerwise"):
        sent, buffer = zero[f"{way}_extra_bytes_sent"], zero[f"{way}_buffer_bytes"]
        print(
            f"  {way:12s} sends {sent / 2**20:9.1f} MiB beyond ZeRO-1's, holds "
            f"{buffer / 2**20:6.1f} MiB gathered, Newton-Schulz {zero[f'{way}_ns_flops']:.3e} FLOP"
        )
    print(json.dumps({**steps, **tp2, **dp2, **zero, "ratio": steps["ours_s"] / steps["torch_s"]}))


def _print_dp2(dp2: dict) -> None:
    """The two ways at ZeRO-1 dp 2, side by side (zero1_dp2_times' keys less dp2_)."""
    dp2 = {k.removeprefix("dp2_"): v for k, v in dp2.items()}
    layerwise = sum(dp2[f"layerwise_{k}_s"] for k in ("reduce", "update", "broadcast"))
    parts = ("scatter", "gather", "ns", "params")
    distributed = sum(dp2[f"distributed_{k}_s"] for k in parts)
    print("  at ZeRO-1 dp 2 (2 ranks), Muon's matrices, per step (the slower rank):")
    print(
        f"    layer-wise: reduce {dp2['layerwise_reduce_s']:.3f} s + update "
        f"{dp2['layerwise_update_s']:.3f} s + broadcast {dp2['layerwise_broadcast_s']:.3f} s = "
        f"{layerwise:.3f} s; sends {dp2['layerwise_sent_bytes'] / 2**20:.1f} MiB, momentum "
        f"{dp2['layerwise_momentum_bytes'] / 2**20:.1f} MiB"
    )
    print(
        f"    distributed: reduce-scatter {dp2['distributed_scatter_s']:.3f} s + bf16 gathers "
        f"{dp2['distributed_gather_s']:.3f} s + Newton-Schulz {dp2['distributed_ns_s']:.3f} s + "
        f"all-gather {dp2['distributed_params_s']:.3f} s = {distributed:.3f} s; sends "
        f"{dp2['distributed_sent_bytes'] / 2**20:.1f} MiB, momentum "
        f"{dp2['distributed_momentum_bytes'] / 2**20:.1f} MiB + "
        f"{dp2['distributed_buffer_bytes'] / 2**20:.1f} MiB gathered"
    )
    print(
        f"    ratio distributed / layer-wise: {distributed / layerwise:.2f} of the best parts, "
        f"{dp2['ratio']:.2f} the median of the repeats' (each runs both ways in turn)"
    )


if __name__ == "__main__":
    main()
