"""Tensor parallelism on this CPU: megatronish at tp=1 and tp=2 against PyTorch's own DTensor
tensor parallelism on the same model.

    python scripts/bench_cpu.py [--arch gpt2 llama] [--repeats 3] [--steps 8] [--warmup 2]

Variants, run as subprocesses, interleaved (each repeat runs every variant once, in turn):

- megatronish tp=1: `megatronish bench`, one process with 2 threads;
- megatronish tp=2: `megatronish bench` at parallel.tp=2, two gloo processes with 1 thread each;
- DTensor tp=2: the same model written as a plain nn.Module with nn.Linear layers (below),
  parallelized with torch.distributed.tensor.parallel.parallelize_module (ColwiseParallel /
  RowwiseParallel, a vocab-parallel embedding and output layer, and loss_parallel, so the
  logits stay split over the vocabulary), two gloo processes with 1 thread each;
- eager tp=1: that plain module, not parallelized, one process with 2 threads (what the
  machine does with no parallelism code at all).

Same shapes everywhere (untied output layer, the vocabulary padded as megatronish pads it) and
the same optimizer step: AdamW and clipping the gradient norm to 1.0. Prints a table of median
tokens/s (and the best run, every run beside it) with the bytes each megatronish rank sent per
step, counted and by the formula, then the ratios of the medians and of the best runs. Load
from outside this script shifts single runs (a process with 2 threads suffers most when a core
is taken away): compare the medians of interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
VOCAB = 257  # the built-in corpus is byte-level: 256 bytes and the end-of-text token
SHAPE = {"n_layer": 4, "d_model": 512, "n_head": 8, "seq_len": 256, "micro_batch": 4}
ARCHS = {
    "gpt2": {"n_kv_head": 8, "d_ff": 2048},
    "llama": {"n_kv_head": 4, "d_ff": 1536},  # megatronish's default d_ff for d_model 512
}


def megatronish_overrides(arch: str, tp: int) -> list[str]:
    """`--set` overrides of configs/tiny.yaml for the benchmark model."""
    s = SHAPE
    return [
        f"model.arch={arch}",
        f"model.n_layer={s['n_layer']}",
        f"model.d_model={s['d_model']}",
        f"model.n_head={s['n_head']}",
        f"model.n_kv_head={ARCHS[arch]['n_kv_head']}",
        f"model.d_ff={ARCHS[arch]['d_ff']}",
        f"model.max_seq_len={s['seq_len']}",
        "model.tie_embeddings=false",
        "model.dropout=0.0",
        f"train.seq_len={s['seq_len']}",
        f"train.micro_batch_size={s['micro_batch']}",
        f"train.global_batch_size={s['micro_batch']}",
        "train.precision=fp32",
        "train.grad_clip=1.0",
        f"parallel.tp={tp}",
    ]


# --------------------------------------------------------------------------------------------
# The plain PyTorch model (shapes: b batch, s sequence, h hidden, n / k query / kv heads, d head
# dim). The fused qkv weight is laid out by kv group (n/k queries, then k, then v of each
# group), as in megatronish, so a column split keeps whole groups on each rank; the view below
# uses -1 heads, so it runs on a local shard as on the full weight.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half rotary embedding of x [b, n, s, d]."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, h: int, n: int, k: int, llama: bool):
        super().__init__()
        self.d, self.group, self.llama = h // n, n // k, llama
        self.qkv = nn.Linear(h, (n + 2 * k) * self.d, bias=not llama)
        self.proj = nn.Linear(n * self.d, h, bias=not llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, self.group + 2, self.d)  # [b, s, k, n/k + 2, d]
        q = qkv[:, :, :, : self.group].reshape(b, s, -1, self.d).transpose(1, 2)  # [b, n, s, d]
        k = qkv[:, :, :, self.group].transpose(1, 2)  # [b, k, s, d]
        v = qkv[:, :, :, self.group + 1].transpose(1, 2)
        if self.llama:
            q, k = rope(q), rope(k)
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h: int, f: int, llama: bool):
        super().__init__()
        self.llama = llama
        if llama:
            self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=not llama)
        self.down = nn.Linear(f, h, bias=not llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, h: int, n: int, k: int, f: int, llama: bool):
        super().__init__()
        norm = (lambda: RMSNorm(h)) if llama else (lambda: nn.LayerNorm(h))
        self.norm1, self.attn = norm(), Attention(h, n, k, llama)
        self.norm2, self.mlp = norm(), MLP(h, f, llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PlainGPT(nn.Module):
    """GPT-2 or Llama in plain PyTorch: tokens [b, s] -> logits [b, s, vocab]."""

    def __init__(self, arch: str, vocab: int):
        super().__init__()
        s, llama = SHAPE, arch == "llama"
        h, n, k, f = s["d_model"], s["n_head"], ARCHS[arch]["n_kv_head"], ARCHS[arch]["d_ff"]
        self.tok_emb = nn.Embedding(vocab, h)
        self.pos_emb = None if llama else nn.Embedding(s["seq_len"], h)
        self.blocks = nn.ModuleList(Block(h, n, k, f, llama) for _ in range(s["n_layer"]))
        self.norm_f = RMSNorm(h) if llama else nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))


def parallelize(model: PlainGPT, arch: str, tp: int) -> PlainGPT:
    """Megatron-style TP through DTensor: vocab-parallel embedding, column-parallel qkv and MLP
    up (and gate), row-parallel projections, a column-parallel output layer whose logits stay
    sharded over the vocabulary (for loss_parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (tp,))
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.up"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.down"] = RowwiseParallel()
        if arch == "llama":
            plan[f"blocks.{i}.mlp.gate"] = ColwiseParallel()
    return parallelize_module(model, mesh, plan)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ for a mix of DTensor and plain parameters (torch's own refuses the mix):
    the squares of sharded gradients are summed over the ranks, replicated ones taken once."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor):
            sq = grad.to_local().double().pow(2).sum()
            if any(placement.is_shard() for placement in grad.placements):
                sharded += sq
                continue
            replicated += sq
        elif grad is not None:
            replicated += grad.double().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sharded)
    norm = float((sharded + replicated).sqrt())
    if norm > max_norm:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def peer_worker(arch: str, steps: int, warmup: int) -> None:
    """One rank of the plain-PyTorch run (tp = WORLD_SIZE); rank 0 prints one JSON line."""
    import contextlib

    import torch.distributed as dist

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1:
        dist.init_process_group("gloo")
    from megatronish.config import padded_vocab

    torch.manual_seed(0)  # the same full weights and batch on every rank
    vocab = padded_vocab(VOCAB, tp)
    model = PlainGPT(arch, vocab)
    loss_ctx = contextlib.nullcontext
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        model, loss_ctx = parallelize(model, arch, tp), loss_parallel
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    b, s = SHAPE["micro_batch"], SHAPE["seq_len"]
    batch = torch.randint(0, VOCAB, (b, s + 1))
    times, losses = [], []
    for step in range(warmup + steps):
        if step == warmup and tp > 1:
            dist.barrier()
        start = time.perf_counter()
        logits = model(batch[:, :-1])
        with loss_ctx():
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
        clip_grad_norm(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - start)
    median = statistics.median(times[warmup:])
    if tp == 1 or dist.get_rank() == 0:
        record = {"tokens_per_s": b * s / median, "step_time_s": median, "first_loss": losses[0]}
        print(json.dumps(record), flush=True)
    if tp > 1:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The driver


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def run(command: list[str], threads: int, cwd: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return last_json(result.stdout)


def ours(arch: str, tp: int, steps: int, warmup: int, cwd: str) -> dict:
    sets = [a for o in megatronish_overrides(arch, tp) for a in ("--set", o)]
    command = [sys.executable, "-m", "megatronish", "bench", "--config"]
    command += [str(REPO / "configs" / "tiny.yaml"), *sets, "--steps", str(steps)]
    return run(command + ["--warmup", str(warmup)], threads=2 // tp, cwd=cwd)


def peer(arch: str, tp: int, steps: int, warmup: int, cwd: str) -> dict:
    script = [str(Path(__file__).resolve()), "_peer", "--arch", arch]
    script += ["--steps", str(steps), "--warmup", str(warmup)]
    if tp == 1:
        return run([sys.executable, *script], threads=2, cwd=cwd)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return run([*launcher, f"--nproc-per-node={tp}", *script], threads=1, cwd=cwd)


VARIANTS = {
    "megatronish tp=1 (1 proc x 2 threads)": lambda arch, *a: ours(arch, 1, *a),
    "megatronish tp=2 (2 procs x 1 thread)": lambda arch, *a: ours(arch, 2, *a),
    "DTensor tp=2 (2 procs x 1 thread)": lambda arch, *a: peer(arch, 2, *a),
    "eager tp=1 (1 proc x 2 threads)": lambda arch, *a: peer(arch, 1, *a),
}


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", nargs="+", default=["gpt2", "llama"], choices=list(ARCHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MEGATRONISH_CACHE", str(Path(tempfile.gettempdir()) / "megatronish"))
    s = SHAPE
    print(
        f"model: {s['n_layer']} layers, d_model {s['d_model']}, {s['n_head']} heads, seq_len "
        f"{s['seq_len']}, micro-batch {s['micro_batch']}, fp32, untied output layer; "
        f"{args.steps} timed steps after {args.warmup} per run; {args.repeats} runs per "
        f"variant, interleaved; {os.cpu_count()} CPU cores",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as cwd:
        for arch in args.arch:
            results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
            loads = []
            for repeat in range(args.repeats):
                for name, fn in VARIANTS.items():
                    loads.append(os.getloadavg()[0])
                    record = fn(arch, args.steps, args.warmup, cwd)
                    results[name].append(record)
                    print(f"  {arch} run {repeat + 1}: {name}: {record['tokens_per_s']:.0f} tok/s")
            for name, records in results.items():
                tps = [r["tokens_per_s"] for r in records]
                rows.append((arch, name, statistics.median(tps), tps, records[-1]))
            print(f"  {arch}: 1-minute load average before runs {min(loads):.1f}-{max(loads):.1f}")
    print()
    header = (
        f"{'arch':6} {'variant':38} {'tok/s median':>12} {'best':>6} {'runs':>26} "
        f"{'MB sent/step/rank':>17} {'formula MB':>10}"
    )
    print(header)
    print("-" * len(header))
    for arch, name, median, tps, record in rows:
        runs = " ".join(f"{x:.0f}" for x in tps)
        sent = record.get("bytes_sent_per_step")
        formula = record.get("bytes_sent_per_step_formula")
        print(
            f"{arch:6} {name:38} {median:12.0f} {max(tps):6.0f} {runs:>26} {_mb(sent):>17} "
            f"{_mb(formula):>10}"
        )
    print()
    runs_of = {(arch, name): tps for arch, name, _, tps, _ in rows}
    for arch in args.arch:
        for label, pick in (("medians", statistics.median), ("best runs", max)):
            tp1, tp2, dtensor, eager = (pick(runs_of[(arch, name)]) for name in VARIANTS)
            print(
                f"{arch} ({label}): megatronish tp=2 / tp=1 = {tp2 / tp1:.2f}x; megatronish "
                f"tp=2 / DTensor tp=2 = {tp2 / dtensor:.2f}x; megatronish tp=1 / eager tp=1 = "
                f"{tp1 / eager:.2f}x"
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_peer":
        worker = argparse.ArgumentParser()
        worker.add_argument("_peer")
        worker.add_argument("--arch", default="gpt2")
        worker.add_argument("--steps", type=int, default=8)
        worker.add_argument("--warmup", type=int, default=2)
        a = worker.parse_args()
        peer_worker(a.arch, a.steps, a.warmup)
    else:
        main()
