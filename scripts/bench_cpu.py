"""CPU training speed: megatronish at tp=1 and tp=2 against PyTorch's own DTensor tensor
parallelism on the same model and against a plain single-process GPT written the way nanoGPT's
model.py writes it.

    python scripts/bench_cpu.py [--shape d256 d512] [--arch gpt2 llama] [--repeats 3]
                                [--steps 8] [--warmup 2]

Shapes (--shape): d256 is 4 layers, d_model 256, 4 heads, seq_len 256, micro-batch 8 with the
output layer tied to the token embedding (megatronish's default for gpt2, and nanoGPT's);
d512 is 4 layers, d_model 512, 8 heads, seq_len 256, micro-batch 4, untied. Both fp32, no
dropout, the built-in byte-level corpus's vocabulary (257) padded as megatronish pads it.

Variants, run as subprocesses, interleaved (each repeat runs every variant once, in turn):

- megatronish tp=1: `megatronish bench`, one process with 2 threads;
- megatronish tp=2: `megatronish bench` at parallel.tp=2, two gloo processes with 1 thread each;
- DTensor tp=2: the same model written as a plain nn.Module with nn.Linear layers (PlainGPT
  below), parallelized with torch.distributed.tensor.parallel.parallelize_module
  (ColwiseParallel / RowwiseParallel, a vocab-parallel embedding and output layer, and
  loss_parallel, so the logits stay split over the vocabulary), two gloo processes with 1
  thread each; always untied (parallelize_module replaces the embedding's and the output
  layer's parameters separately, so a tie would not survive it);
- eager tp=1: PlainGPT not parallelized, one process with 2 threads, untied;
- nanoGPT-style tp=1 (gpt2 only): NanoStyleGPT below, one process with 2 threads: the math of
  nanoGPT's model.py and train.py in our own code (nn.Linear c_attn / c_proj / c_fc layers with
  biases, nn.LayerNorm, q, k and v split from c_attn's output as views, causal
  F.scaled_dot_product_attention, tanh-GELU MLP, the output layer tied as the shape says,
  F.cross_entropy over the padded vocabulary), torch.optim.AdamW with nanoGPT's CPU settings
  (torch's default on CPU, neither fused nor foreach: nanoGPT asks for fused on CUDA only) and
  weight decay on 2-D parameters, torch.nn.utils.clip_grad_norm_ to 1.0.

Every variant runs the same optimizer step: AdamW and clipping the gradient norm to 1.0. The
megatronish rows read their batches from the prepared corpus; the plain rows train on one
random batch (the batch's contents do not change the work). Prints a table of median tokens/s
(and the best run, every run beside it) with the bytes each megatronish rank sent per step,
counted and by the formula, then the ratios of the medians and of the best runs. Load from
outside this script shifts single runs (a process with 2 threads suffers most when a core is
taken away): each run reports the share of the cores other processes used while it ran (from
/proc/stat, less this script's children), a run where they took more than --busy is run again
(--retries), and the table shows the most any counted run shared. Compare the medians of
interleaved runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
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
SHAPES = {
    "d256": {"n_layer": 4, "d_model": 256, "n_head": 4, "seq_len": 256, "micro_batch": 8,
             "tie": True},
    "d512": {"n_layer": 4, "d_model": 512, "n_head": 8, "seq_len": 256, "micro_batch": 4,
             "tie": False},
}  # fmt: skip
ARCHS = ("gpt2", "llama")


def model_dims(shape: dict, arch: str) -> tuple[int, int, int, int]:
    """(h, n, k, f) of a shape: gpt2 has n kv heads and d_ff 4 h; llama n / 2 kv heads and
    megatronish's default d_ff (8 h / 3 rounded up to a multiple of 256)."""
    h, n = shape["d_model"], shape["n_head"]
    if arch == "gpt2":
        return h, n, n, 4 * h
    return h, n, n // 2, -(-(8 * h // 3) // 256) * 256


def megatronish_overrides(shape: dict, arch: str, tp: int) -> list[str]:
    """`--set` overrides of configs/tiny.yaml for the benchmark model."""
    s = shape
    h, n, k, f = model_dims(s, arch)
    return [
        f"model.arch={arch}",
        f"model.n_layer={s['n_layer']}",
        f"model.d_model={h}",
        f"model.n_head={n}",
        f"model.n_kv_head={k}",
        f"model.d_ff={f}",
        f"model.max_seq_len={s['seq_len']}",
        f"model.tie_embeddings={str(s['tie']).lower()}",
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

    def __init__(self, shape: dict, arch: str, vocab: int):
        super().__init__()
        s, llama = shape, arch == "llama"
        h, n, k, f = model_dims(s, arch)
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


# --------------------------------------------------------------------------------------------
# The nanoGPT-style baseline: GPT-2 as nanoGPT's model.py computes it (b batch, s sequence,
# h hidden, n heads, d = h / n). c_attn's output is [q | k | v], each h wide, so q, k and v are
# views of it; the head split is a view and a transpose, as there.


class NanoAttention(nn.Module):
    def __init__(self, h: int, n: int):
        super().__init__()
        self.n = n
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (
            t.view(b, s, self.n, h // self.n).transpose(1, 2)  # [b, n, s, d]
            for t in self.c_attn(x).split(h, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))


class NanoBlock(nn.Module):
    def __init__(self, h: int, n: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(h), NanoAttention(h, n), nn.LayerNorm(h)
        self.c_fc, self.c_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class NanoStyleGPT(nn.Module):
    """GPT-2 in nanoGPT's style: tokens [b, s] -> logits [b, s, vocab]."""

    def __init__(self, shape: dict, vocab: int):
        super().__init__()
        h, n = shape["d_model"], shape["n_head"]
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(shape["seq_len"], h)
        self.h = nn.ModuleList(NanoBlock(h, n) for _ in range(shape["n_layer"]))
        self.ln_f, self.lm_head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)
        if shape["tie"]:
            self.lm_head.weight = self.wte.weight
        for name, param in self.named_parameters():  # GPT-2's init, as nanoGPT's
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:
                residual = name.endswith("c_proj.weight")
                std = 0.02 / math.sqrt(2 * shape["n_layer"]) if residual else 0.02
                nn.init.normal_(param, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


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


def peer_worker(shape_name: str, arch: str, model_kind: str, steps: int, warmup: int) -> None:
    """One rank of a plain-PyTorch run (tp = WORLD_SIZE): model_kind "plain" (PlainGPT, with
    DTensor at tp > 1) or "nano" (NanoStyleGPT, tp = 1); rank 0 prints one JSON line."""
    import torch.distributed as dist

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1:
        dist.init_process_group("gloo")
    from megatronish.config import padded_vocab

    torch.manual_seed(0)  # the same full weights and batch on every rank
    shape, vocab = SHAPES[shape_name], padded_vocab(VOCAB, tp)
    loss_ctx = contextlib.nullcontext
    if model_kind == "nano":
        model = NanoStyleGPT(shape, vocab)
        params = list(model.parameters())  # the tied weight once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))

        def clip(params: list[nn.Parameter]) -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
    else:
        model = PlainGPT(shape, arch, vocab)
        if tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            model, loss_ctx = parallelize(model, arch, tp), loss_parallel
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)

        def clip(params: list[nn.Parameter]) -> None:
            clip_grad_norm(params, 1.0)

    b, s = shape["micro_batch"], shape["seq_len"]
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
        clip(params)
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


def cpu_clock() -> tuple[float, float, float]:
    """(wall s, CPU s every process on the machine has used, CPU s of this script's finished
    children), for `others_share`; the machine's total is 0 where /proc/stat is missing."""
    busy = 0.0
    with contextlib.suppress(OSError):
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), busy, children.ru_utime + children.ru_stime


def others_share(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """The fraction of the machine's cores that processes other than the run used between two
    `cpu_clock` readings (0 where it cannot be measured)."""
    wall, busy, ours_s = (b - a for a, b in zip(start, end))
    return max(0.0, busy - ours_s) / (wall * (os.cpu_count() or 1)) if busy > 0 else 0.0


def run(command: list[str], threads: int, cwd: str) -> dict:
    """The run's JSON record, with `others_cpu`: the share of the cores others used meanwhile."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    start = cpu_clock()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return dict(last_json(result.stdout), others_cpu=others_share(start, cpu_clock()))


def ours(shape: str, arch: str, tp: int, steps: int, warmup: int, cwd: str) -> dict:
    sets = [a for o in megatronish_overrides(SHAPES[shape], arch, tp) for a in ("--set", o)]
    command = [sys.executable, "-m", "megatronish", "bench", "--config"]
    command += [str(REPO / "configs" / "tiny.yaml"), *sets, "--steps", str(steps)]
    return run(command + ["--warmup", str(warmup)], threads=2 // tp, cwd=cwd)


def peer(
    shape: str, arch: str, kind: str, tp: int, steps: int, warmup: int, cwd: str
) -> dict | None:
    """A plain-PyTorch run (None where the variant has no such model: nano is gpt2 only)."""
    if kind == "nano" and arch != "gpt2":
        return None
    script = [str(Path(__file__).resolve()), "_peer", "--shape", shape, "--arch", arch]
    script += ["--model", kind, "--steps", str(steps), "--warmup", str(warmup)]
    if tp == 1:
        return run([sys.executable, *script], threads=2, cwd=cwd)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return run([*launcher, f"--nproc-per-node={tp}", *script], threads=1, cwd=cwd)


TP1, TP2 = "megatronish tp=1 (1 proc x 2 threads)", "megatronish tp=2 (2 procs x 1 thread)"
DTENSOR, EAGER = "DTensor tp=2 (2 procs x 1 thread)", "eager tp=1 (1 proc x 2 threads)"
NANO = "nanoGPT-style tp=1 (1 proc x 2 threads)"
VARIANTS = {
    TP1: lambda shape, arch, *a: ours(shape, arch, 1, *a),
    TP2: lambda shape, arch, *a: ours(shape, arch, 2, *a),
    DTENSOR: lambda shape, arch, *a: peer(shape, arch, "plain", 2, *a),
    EAGER: lambda shape, arch, *a: peer(shape, arch, "plain", 1, *a),
    NANO: lambda shape, arch, *a: peer(shape, arch, "nano", 1, *a),
}


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.3f}"


def describe(name: str) -> str:
    s = SHAPES[name]
    return (
        f"{name}: {s['n_layer']} layers, d_model {s['d_model']}, {s['n_head']} heads, seq_len "
        f"{s['seq_len']}, micro-batch {s['micro_batch']}, fp32, "
        f"{'tied' if s['tie'] else 'untied'} output layer (DTensor and eager: untied)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--busy", type=float, default=0.1,
        help="a run during which other processes used more than this share of the cores is "
        "run again (up to --retries times; the last try counts)",
    )  # fmt: skip
    parser.add_argument("--retries", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MEGATRONISH_CACHE", str(Path(tempfile.gettempdir()) / "megatronish"))
    for shape in args.shape:
        print(describe(shape), flush=True)
    print(
        f"{args.steps} timed steps after {args.warmup} per run; {args.repeats} runs per "
        f"variant, interleaved; {os.cpu_count()} CPU cores",
        flush=True,
    )
    rows = []
    cases = [(shape, arch) for shape in args.shape for arch in args.arch]
    with tempfile.TemporaryDirectory() as cwd:
        for shape, arch in cases:
            results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
            loads = []
            for repeat in range(args.repeats):
                for name, fn in VARIANTS.items():
                    for _ in range(args.retries + 1):
                        loads.append(os.getloadavg()[0])
                        record = fn(shape, arch, args.steps, args.warmup, cwd)
                        if record is None:
                            break
                        print(
                            f"  {shape} {arch} run {repeat + 1}: {name}: "
                            f"{record['tokens_per_s']:.0f} tok/s (others used "
                            f"{100 * record['others_cpu']:.0f}% of the cores)",
                            flush=True,
                        )
                        if record["others_cpu"] <= args.busy:
                            break
                    if record is not None:
                        results[name].append(record)
            for name, records in results.items():
                if records:
                    tps = [r["tokens_per_s"] for r in records]
                    busy = max(r["others_cpu"] for r in records)
                    rows.append((shape, arch, name, statistics.median(tps), tps, records[-1], busy))
            print(f"  {shape} {arch}: 1-minute load average before runs {min(loads):.1f}-"
                  f"{max(loads):.1f}")  # fmt: skip
    print()
    header = (
        f"{'shape':5} {'arch':5} {'variant':40} {'tok/s median':>12} {'best':>6} {'runs':>26} "
        f"{'MB sent/step/rank':>17} {'formula MB':>10} {'others max':>10}"
    )
    print(header)
    print("-" * len(header))
    for shape, arch, name, median, tps, record, busy in rows:
        runs = " ".join(f"{x:.0f}" for x in tps)
        sent = record.get("bytes_sent_per_step")
        formula = record.get("bytes_sent_per_step_formula")
        print(
            f"{shape:5} {arch:5} {name:40} {median:12.0f} {max(tps):6.0f} {runs:>26} "
            f"{_mb(sent):>17} {_mb(formula):>10} {100 * busy:9.0f}%"
        )
    print()
    runs_of = {(shape, arch, name): tps for shape, arch, name, _, tps, _, _ in rows}
    for shape, arch in cases:
        for label, pick in (("medians", statistics.median), ("best runs", max)):
            of = {name: pick(runs_of[(shape, arch, name)]) for name in VARIANTS
                  if (shape, arch, name) in runs_of}  # fmt: skip
            ratios = [
                f"megatronish tp=2 / tp=1 = {of[TP2] / of[TP1]:.2f}x",
                f"megatronish tp=2 / DTensor tp=2 = {of[TP2] / of[DTENSOR]:.2f}x",
                f"megatronish tp=1 / eager tp=1 = {of[TP1] / of[EAGER]:.2f}x",
            ]
            if NANO in of:
                ratios.append(f"megatronish tp=1 / nanoGPT-style tp=1 = {of[TP1] / of[NANO]:.2f}x")
            print(f"{shape} {arch} ({label}): " + "; ".join(ratios))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_peer":
        worker = argparse.ArgumentParser()
        worker.add_argument("_peer")
        worker.add_argument("--shape", default="d256", choices=list(SHAPES))
        worker.add_argument("--arch", default="gpt2", choices=list(ARCHS))
        worker.add_argument("--model", default="plain", choices=("plain", "nano"))
        worker.add_argument("--steps", type=int, default=8)
        worker.add_argument("--warmup", type=int, default=2)
        a = worker.parse_args()
        peer_worker(a.shape, a.arch, a.model, a.steps, a.warmup)
    else:
        main()
