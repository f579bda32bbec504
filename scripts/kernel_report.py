"""Every Triton kernel compiled for GPU targets on any machine (no GPU needed): registers,
spills and shared memory against each architecture's limit, at the shapes the shipped configs
use.

    python scripts/kernel_report.py --arch sm_80 sm_89 sm_90 [--json FILE] [--jobs N]
                                    [--representative] [--only WORD...]

For each shipped config (configs/gpt2-124m, gpt2-350m, gpt2-1.3b, llama-1b, tiny-moe) at tp 1, 2 and
8 where the heads divide, for the head dim 128 of the benchmarks, and for DeepSeek-V3's latent
attention (query-key head dim 192, value head dim 128: MLA_V3), in bf16 and fp32, it builds the
launches of one training step as the launchers make them
(megatronish_kernels.compile_check.model_launches: attention forward and backward, the ring-
attention blocks, both again under document masks and (llama) under a sliding window, norms, RoPE,
SwiGLU or bias-GELU, cross entropy, the expert GEMMs, and for sm_89 and sm_90 the fp8 casts and
GEMMs, which sm_80 lacks; those also at the shapes of llama3-8b, mistral-7b and qwen3-30b-a3b; and
the gated delta rule's nine forward and backward kernels at Qwen3.5's linear attention, QWEN35_GDN;
and attention with sinks at gpt-oss-20b's shapes and with soft-capped scores at gemma-3-27b's,
whole, under their sliding window and under it with document masks: compile_scores),
compiles each distinct one for each arch with the ptxas Triton ships, and prints one table: kernel,
configuration (constexprs, arguments specialized to 1, warps w and stages s), arch, dtype,
registers, spill bytes, shared memory / the arch's limit per block, the estimated occupancy (warps
per SM of 64, 48 on sm_89, from registers and shared memory), the configs that launch it, and a
status. A row FAILs when its shared memory is over the limit, or when it spills at bf16 or fp8 (fp32
runs exact-fp32 dots without tensor cores: spills there are reported, not failed). --representative
compiles one bf16 configuration per kernel (and per attention kernel one more, under document masks
and a sliding window at MLA_V3's head dims) only: what the tests compile. --only WORD... keeps the
launches whose kernel name and origin ("llama-1b tp2 ring window documents") hold every word (--only
window: the attention kernels under a sliding window). --json FILE writes the rows as a list of
objects (kernel, config, arch, dtype, registers, spill_bytes, shared_bytes, shared_limit_bytes,
num_warps, num_stages, occupancy_warps, models).

Exit status: 0 every row fits, 1 a row fails, 2 Triton cannot compile for NVIDIA targets here.
Compiled kernels go to Triton's cache (TRITON_CACHE_DIR), so a second run takes seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before the kernels are defined: compile, not interpret

from megatronish_kernels import compile_check  # noqa: E402
from megatronish_kernels.compile_check import ARCHS, Compiled, Launch, ModelShapes  # noqa: E402
from megatronish_kernels.compile_gdn import GatedDeltaShapes, gated_delta_launches  # noqa: E402
from megatronish_kernels.compile_scores import SCORE_SHAPES, score_launches  # noqa: E402

from megatronish.config import derive, load_config  # noqa: E402
from megatronish.errors import UserError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("gpt2-124m", "gpt2-350m", "gpt2-1.3b", "llama-1b", "tiny-moe")
# Configs whose fp8 launches (the casts and GEMMs of their linear layers) are compiled too.
FP8_CONFIGS = ("llama3-8b", "mistral-7b", "qwen3-30b-a3b")
TP_DEGREES = (1, 2, 8)  # and each config's own parallel.tp
# The dataset's vocabulary, for a config that leaves model.vocab_size to it: tiny-moe trains on
# the built-in corpus (byte tokenizer, 257 ids), llama-1b's comment prepares 32000 BPE ids.
DATASET_VOCAB = {"llama-1b": 32000, "tiny-moe": 257}
# One bf16 configuration per kernel (the tests' and gpu_check's): the first launch of each
# kernel over these (config, tp), in order; together they cover every kernel.
REPRESENTATIVE = (("llama-1b", 2), ("gpt2-124m", 1), ("tiny-moe", 1))


def model_shapes(name: str, tp: int) -> ModelShapes | None:
    """One tp rank's shapes of configs/NAME.yaml at tensor-parallel degree tp, or None when
    the config does not split over tp (heads, kv heads or widths do not divide)."""
    # One data-parallel rank (the shapes do not depend on dp; ep then takes 1).
    sets = [f"parallel.tp={tp}", "parallel.dp=1", "parallel.ep=1"]
    cfg = load_config(REPO / "configs" / f"{name}.yaml", sets)
    m, t = cfg.model, cfg.train
    if m.n_head % tp or (m.n_kv_head or m.n_head) % tp:
        return None
    try:
        d = derive(cfg, tp * cfg.parallel.cp * cfg.parallel.pp, DATASET_VOCAB.get(name))
    except UserError:  # a width that does not divide: not a layout this config can run
        return None
    local_seq = t.seq_len // d.cp
    sequence_parallel = cfg.parallel.sequence_parallel and tp > 1
    return ModelShapes(
        name=f"{name} tp{tp}",
        family=m.arch,
        batch=t.micro_batch_size,
        seq_len=local_seq,
        d_model=m.d_model,
        head_dim=d.head_dim,
        n_head=m.n_head // tp,
        n_kv_head=d.n_kv_head // tp,
        d_ff=d.d_ff // tp,
        vocab=d.padded_vocab_size // tp,
        norm_rows=t.micro_batch_size * local_seq // (tp if sequence_parallel else 1),
        experts=m.moe.num_experts // d.ep,
        top_k=m.moe.top_k if m.moe.num_experts else 0,
        expert_d_ff=d.moe_d_ff // tp,
    )


# Head dim 128, which no shipped config has but the tiles distinguish: the shapes
# scripts/bench_kernels.py and gpu_check.py time (attention b4 h32/kv8 s2048 d128, rms_norm
# 8192 x 4096, cross entropy over 50304 ids), as one Llama-style rank.
BENCH_D128 = ModelShapes(
    name="bench-d128 tp1", family="llama", batch=4, seq_len=2048, d_model=4096, head_dim=128,
    n_head=32, n_kv_head=8, d_ff=14336, vocab=50304, norm_rows=8192,
)  # fmt: skip


# DeepSeek-V3's multi-head latent attention, one rank of tp 8 at s 4096: 16 of its 128 heads,
# each with its own keys and values, a query-key head dim of 192 (128 + the 64 RoPE dims) and
# values of 128; its dense MLP width and vocabulary over tp 8 (no experts).
MLA_V3 = ModelShapes(
    name="mla-v3 tp8", family="llama", batch=1, seq_len=4096, d_model=7168, head_dim=192,
    n_head=16, n_kv_head=16, d_ff=2304, vocab=16160, norm_rows=4096, v_head_dim=128,
    rope_dim=64,
)  # fmt: skip


# Qwen3.5's linear attention (transformers' Qwen3_5Config defaults: 16 query-key heads of 128,
# 32 value heads of 128), one rank of tp 1 at s 4096: the gated delta rule's kernels.
QWEN35_GDN = GatedDeltaShapes(
    name="qwen3.5-linear-attention tp1", batch=1, seq_len=4096, heads=32, k_head_dim=128,
    v_head_dim=128,
)  # fmt: skip


def _gated_delta_runs(arch_names: list[str], only: list[str] | None) -> list:
    """(arch name, launch, user) of the gated delta rule's launches at QWEN35_GDN, bf16 and
    fp32, whose kernel name and origin hold the words of only (None: all)."""
    runs = []
    for arch_name in arch_names:
        for dtype in ("bf16", "fp32"):
            for launch in gated_delta_launches(QWEN35_GDN, compile_check.DTYPES[dtype]):
                if not only or all(w in f"{launch.name} {QWEN35_GDN.name}" for w in only):
                    runs.append((arch_name, launch, QWEN35_GDN.name))
    return runs


def _score_runs(arch_names: list[str], only: list[str] | None) -> list:
    """(arch name, launch, user) of the attention launches with sinks or a soft-cap
    (compile_scores.SCORE_SHAPES), bf16 and fp32, whose kernel name and origin hold the words
    of only (None: all)."""
    runs = []
    for arch_name in arch_names:
        for dtype in ("bf16", "fp32"):
            for shapes in SCORE_SHAPES:
                torch_dtype, capability = compile_check.DTYPES[dtype], ARCHS[arch_name].capability
                for launch, where in score_launches(shapes, torch_dtype, capability):
                    user = f"{shapes.model.name} {where}"
                    if not only or all(w in f"{launch.name} {user}" for w in only):
                        runs.append((arch_name, launch, user))
    return runs


def shipped_shapes(names: tuple[str, ...] = CONFIGS) -> list[ModelShapes]:
    """Every shipped config of `names` at every tp degree it splits over (1, 2, 8 and its own),
    then (for CONFIGS) the head-dim-128 shape of the benchmarks and DeepSeek-V3's latent
    attention."""
    shapes = []
    for name in names:
        own = load_config(REPO / "configs" / f"{name}.yaml").parallel.tp
        for tp in sorted({*TP_DEGREES, own}):
            shapes.append(model_shapes(name, tp))
    extra = [BENCH_D128, MLA_V3] if names == CONFIGS else []
    return [s for s in shapes if s is not None] + extra


def _launches(shapes: ModelShapes, dtype: str, arch_name: str, fp8_only: bool) -> list:
    """model_launches, or only the fp8 ones (compile_check.fp8_launches, tagged fp8)."""
    arch = ARCHS[arch_name]
    if not fp8_only:
        return compile_check.model_launches(shapes, dtype, arch)
    launches = compile_check.fp8_launches(shapes, compile_check.DTYPES[dtype], arch.capability)
    return [(launch, "fp8") for launch in launches]


def _key(launch: Launch, arch_name: str) -> tuple:
    signature, constexprs, attrs = compile_check.specialization(launch)
    return (
        arch_name, launch.name, tuple(signature.items()), repr(sorted(constexprs.items())),
        repr(sorted(attrs)), launch.num_warps, launch.num_stages,
    )  # fmt: skip


def plan(
    arch_names: list[str], representative: bool, only: list[str] | None = None
) -> tuple[list, dict]:
    """The distinct launches to compile, [(key, (arch name, launch))], and the users of each
    key ("llama-1b tp2", or "llama-1b tp2 ring" for a ring-attention block); only: words each
    kept launch's kernel name and origin hold (None: every launch)."""
    jobs, users = {}, {}
    if representative:
        runs = [(model_shapes(name, tp), "bf16", False) for name, tp in REPRESENTATIVE]
        runs.append((MLA_V3, "bf16", False))
    else:
        runs = [(s, dtype, False) for s in shipped_shapes() for dtype in ("bf16", "fp32")]
        runs += [(s, d, True) for s in shipped_shapes(FP8_CONFIGS) for d in ("bf16", "fp32")]
    for arch_name in arch_names:
        seen_kernels = set()  # (kernel, document masks, sliding window, split query-key dim)
        for shapes, dtype, fp8_only in runs:
            for launch, where in _launches(shapes, dtype, arch_name, fp8_only):
                described = f"{launch.name} {shapes.name} {where}"
                if only and not all(word in described for word in only):
                    continue
                flags = launch.constexprs
                docs, window = bool(flags.get("DOCS")), bool(flags.get("WINDOW"))
                split = bool(flags.get("QK_REST"))
                variant = (launch.name, docs, window, split)
                # Representative: each attention kernel plain, and once with everything on
                # (document masks, a sliding window, MLA_V3's split query-key dim), whose code
                # holds each feature's.
                if representative and (variant in seen_kernels or not docs == window == split):
                    continue
                seen_kernels.add(variant)
                key = _key(launch, arch_name)
                jobs.setdefault(key, (arch_name, launch))
                users.setdefault(key, []).append(f"{shapes.name} {where}".strip())
    if not representative:
        extra = _gated_delta_runs(arch_names, only) + _score_runs(arch_names, only)
        for arch_name, launch, user in extra:
            key = _key(launch, arch_name)
            jobs.setdefault(key, (arch_name, launch))
            users.setdefault(key, []).append(user)
    return list(jobs.items()), users


_JOBS: list = []  # the planned jobs, for the forked workers


def _compile(index: int) -> Compiled:
    _, (arch_name, launch) = _JOBS[index]
    return compile_check.compile_and_measure(launch, ARCHS[arch_name])


def compile_all(jobs: list, workers: int) -> list[Compiled]:
    """Compiles every planned job, in workers forked processes (1: in this one)."""
    _JOBS[:] = jobs
    if workers <= 1 or len(jobs) <= 1 or sys.platform != "linux":
        return [_compile(i) for i in range(len(jobs))]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_compile, range(len(jobs))))


def merge(compiled: list[Compiled], users: list[list[str]]) -> list[Compiled]:
    """One row per (kernel, configuration, arch, dtype): launches that differ only in how
    their sizes specialize (a head count divisible by 16 or not, a ring block's fp32 output)
    are merged into their worst case (most registers, spills and shared memory, least
    occupancy), used by all of their users. Sorted by kernel, arch, dtype, configuration."""
    rows: dict[tuple, Compiled] = {}
    for row, names in zip(compiled, users, strict=True):
        key = (row.kernel, row.config, row.arch, row.dtype)
        seen = rows.get(key)
        if seen is None:
            rows[key] = replace(row, models=tuple(dict.fromkeys(names)))
            continue
        rows[key] = replace(
            seen,
            registers=max(seen.registers, row.registers),
            spill_bytes=max(seen.spill_bytes, row.spill_bytes),
            shared_bytes=max(seen.shared_bytes, row.shared_bytes),
            occupancy_warps=min(seen.occupancy_warps, row.occupancy_warps),
            models=tuple(dict.fromkeys([*seen.models, *names])),
        )
    return sorted(rows.values(), key=lambda r: (r.kernel, r.arch, r.dtype, r.config))


def _short_models(names: tuple[str, ...]) -> str:
    """Users grouped by config: "gpt2-124m tp1,2; llama-1b tp2 ring"."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:  # "llama-1b tp2", or "llama-1b tp2 ring"
        config, tp, *where = name.split(" ")
        groups.setdefault((config, " ".join(where)), []).append(tp.removeprefix("tp"))
    return "; ".join(
        f"{config} tp{','.join(tps)}" + (f" {where}" if where else "")
        for (config, where), tps in groups.items()
    )


def status(row: Compiled) -> str:
    """ok, or FAIL with the problems compile_check finds (spills allowed in fp32 only)."""
    found = compile_check.problems(row, spills_allowed=row.dtype == "fp32")
    if found:
        return "FAIL: " + "; ".join(p.split(": ", 1)[1] for p in found)
    return "ok" if not row.spill_bytes else "ok (fp32 spills)"


def render(rows: list[Compiled]) -> str:
    """The table: a header line, then one line per row."""
    header = ("kernel", "configuration", "arch", "dtype", "regs", "spill B", "shared KB / limit")
    header += ("warps/SM", "status", "used by")
    lines = [header]
    for r in rows:
        shared = f"{r.shared_bytes / 1024:.1f} / {r.shared_limit_bytes // 1024}"
        lines.append(
            (r.kernel, r.config, r.arch, r.dtype, str(r.registers), str(r.spill_bytes), shared)
            + (str(r.occupancy_warps), status(r), _short_models(r.models))
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
        for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=sorted(ARCHS))
    parser.add_argument("--json", metavar="FILE", help="write the rows here as JSON")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile workers")
    parser.add_argument(
        "--representative", action="store_true", help="one bf16 configuration per kernel"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="WORD", help="the launches whose kernel and origin hold these"
    )
    args = parser.parse_args(argv)
    reason = compile_check.compile_support()
    if reason is not None:
        print(f"kernel_report: cannot compile for NVIDIA targets here: {reason}", file=sys.stderr)
        return 2
    start = time.monotonic()
    jobs, users = plan(args.arch, args.representative, args.only)
    compiled = compile_all(jobs, args.jobs)
    rows = merge(compiled, [users[key] for key, _ in jobs])
    print(render(rows))
    failed = [r for r in rows if status(r).startswith("FAIL")]
    print(
        f"\n{len(jobs)} compilations of {len({r.kernel for r in rows})} kernels for "
        f"{' and '.join(args.arch)} in {time.monotonic() - start:.0f} s: {len(rows)} rows, "
        f"{len(failed)} failed"
    )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
