"""Benchmark of the Triton kernels (megatronish_kernels) against torch, with the device ceilings.

    python scripts/bench_kernels.py            # CUDA: ceilings, then every kernel, bf16
    python scripts/bench_kernels.py --check    # correctness of every kernel at small shapes only

On CUDA it first measures the ceilings (device-to-device copy bandwidth, bf16 GEMM TFLOP/s),
then times torch eager, torch SDPA (attention) and ours, forward and forward+backward, as the
median of CUDA-event timings after warm-up, at realistic shapes (hidden 4096, sequence 2k-8k,
head dim 128, vocab 50k-128k split over tp = 1, 2, 4: the per-rank shard on one GPU). Each row
gives the achieved TB/s or TFLOP/s and its % of the measured ceiling; cross entropy adds the
peak memory of forward+backward. The targets are printed with pass/fail.

Without CUDA it says so, checks every kernel once under Triton's interpreter at small shapes
against the torch reference, then runs the whole benchmark pipeline once at tiny shapes (a dry
run whose numbers are not performance) so the script is exercised up to the timing. Exit 0 when
every check passes.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from megatronish_kernels import functions as kernels  # noqa: E402

from megatronish import ops  # noqa: E402
from megatronish.ops import reference  # noqa: E402

TARGET_NORM_COPY_FRACTION = 0.85  # norms fwd+bwd: >= 85% of copy bandwidth
TARGET_ATTN_FWD = 0.9  # attention fwd: >= 0.9x SDPA speed
TARGET_ATTN_BWD = 0.8  # attention bwd: >= 0.8x SDPA speed
TARGET_CE_SPEEDUP = 2.0  # cross entropy fwd+bwd: >= 2x torch eager


def eager_attention(q, k, v, causal=True):
    """softmax(q k^T / sqrt(d)) v with the s x s matrix in memory (what SDPA avoids)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, device=q.device).triu(1).bool(), -math.inf)
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


def torch_layer_cross_entropy(logits, target):
    """The project's torch backend (megatronish.layers), single device."""
    from megatronish.layers.cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, target)


def triton_rope(x):
    """The kernel with the table ops.rope builds for it (the model's call)."""
    return ops.rope(x, backend="triton")


def f_cross_entropy(logits, target):
    return F.cross_entropy(logits, target, reduction="none")


@dataclass
class Case:
    """One kernel at one shape: how to build its inputs, the implementations to time, and the
    work of forward and of forward+backward (bytes moved or FLOPs)."""

    kernel: str
    shape: str
    make_inputs: Callable[[], list]
    impls: dict[str, Callable]
    work_fwd: float
    work_fwd_bwd: float
    unit: str  # "TB/s" or "TFLOP/s"
    results: dict[str, dict[str, float]] = field(default_factory=dict)


def leaf(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_(True)


def build_cases(device: str, dtype: torch.dtype, tiny: bool) -> list[Case]:
    """The benchmark plan: realistic shapes on CUDA, tiny ones for a dry run."""
    size = 2 if dtype == torch.bfloat16 else 4
    rows, hidden, ffn = (24, 40, 56) if tiny else (8192, 4096, 11008)
    cases = []
    for name in ("rms_norm", "layer_norm"):
        ref = getattr(reference, name)
        extra = [] if name == "rms_norm" else [leaf(hidden, dtype=dtype, device=device)]

        def make(extra=extra):
            x = leaf(rows, hidden, dtype=dtype, device=device)
            return [x, leaf(hidden, dtype=dtype, device=device), *extra, 1e-5]

        moved = rows * hidden * size  # one pass over x
        impls = {"torch eager": ref, "ours": getattr(kernels, name)}
        cases.append(Case(name, f"{rows}x{hidden}", make, impls, 2 * moved, 5 * moved, "TB/s"))
    b, n, s, d = (1, 2, 24, 16) if tiny else (4, 32, 4096, 128)
    moved = b * n * s * d * size
    cases.append(
        Case(
            "rope",
            f"{b}x{n}x{s}x{d}",
            lambda: [leaf(b, n, s, d, dtype=dtype, device=device)],
            {"torch eager": reference.rope, "ours": triton_rope},
            2 * moved,
            4 * moved,
            "TB/s",
        )  # fmt: skip
    )
    moved = rows * ffn * size
    pair = lambda: [leaf(rows, ffn, dtype=dtype, device=device, scale=2) for _ in range(2)]  # noqa: E731
    cases.append(
        Case(
            "swiglu",
            f"{rows}x{ffn}",
            pair,
            {"torch eager": reference.swiglu, "ours": kernels.swiglu},
            3 * moved,
            8 * moved,
            "TB/s",
        )  # fmt: skip
    )
    cases.append(
        Case(
            "bias_gelu",
            f"{rows}x{ffn}",
            lambda: [
                leaf(rows, ffn, dtype=dtype, device=device),
                leaf(ffn, dtype=dtype, device=device),
            ],
            {"torch eager": reference.bias_gelu, "ours": kernels.bias_gelu},
            2 * moved,
            5 * moved,
            "TB/s",
        )  # fmt: skip
    )
    attn_shapes = [(1, 4, 2, 40, 16)] if tiny else [(4, 32, 8, 2048, 128), (2, 32, 8, 4096, 128),
                                                    (1, 32, 8, 8192, 128)]  # fmt: skip
    for b, nh, nkv, s, d in attn_shapes:
        flops = 4 * b * nh * s * s * d * 0.5  # causal: half the score matrix
        cases.append(
            Case(
                "attention",
                f"b{b} h{nh}/kv{nkv} s{s} d{d}",
                lambda b=b, nh=nh, nkv=nkv, s=s, d=d: [
                    leaf(b, nh, s, d, dtype=dtype, device=device),
                    leaf(b, nkv, s, d, dtype=dtype, device=device),
                    leaf(b, nkv, s, d, dtype=dtype, device=device),
                    True,
                ],
                {
                    "torch eager": eager_attention,
                    "torch SDPA": reference.attention,
                    "ours": kernels.attention,
                },
                flops,
                3.5 * flops,
                "TFLOP/s",
            )  # fmt: skip
        )
    ce_shapes = (
        [(24, 67, 1)] if tiny else [(8192, v, tp) for v in (50304, 128256) for tp in (1, 2, 4)]
    )
    for tokens, vocab, tp in ce_shapes:
        local = vocab // tp

        def make(tokens=tokens, local=local):
            target = torch.randint(0, local, (tokens,), device=device)
            return [leaf(tokens, local, dtype=dtype, device=device, scale=3), target]

        moved = tokens * local * size
        impls = {"torch eager": f_cross_entropy, "torch layer": torch_layer_cross_entropy,
                 "ours": lambda x, t: kernels.cross_entropy(x, t, None)}  # fmt: skip
        shape = f"{tokens}x{vocab}/tp{tp}"
        cases.append(Case("cross_entropy", shape, make, impls, moved, 3 * moved, "TB/s"))
    return cases


def timer(device: str, warmup: int, iters: int) -> Callable[[Callable], float]:
    """Median milliseconds of fn(): CUDA events on CUDA, perf_counter elsewhere."""

    def measure(fn: Callable) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)

    return measure


def measure_ceilings(device: str, tiny: bool, measure) -> dict[str, float]:
    """Copy bandwidth (TB/s, read + write) and bf16 GEMM rate (TFLOP/s) of this device."""
    n = 1 << (20 if tiny else 30)  # 1 Gi bf16 elements (2 GiB) on CUDA
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    src = torch.randn(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy_ms = measure(lambda: dst.copy_(src))
    copy_bytes = 2 * src.numel() * src.element_size()
    src = dst = None  # free 4 GiB before the GEMM
    m = 512 if tiny else 8192
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    gemm_ms = measure(lambda: a @ b)
    return {"TB/s": copy_bytes / copy_ms / 1e9, "TFLOP/s": 2 * m**3 / gemm_ms / 1e9}


def run_case(case: Case, device: str, measure) -> None:
    """Fills case.results[impl] with fwd_ms, fwd_bwd_ms and (CUDA) peak_mib of fwd+bwd."""
    inputs = case.make_inputs()
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for name, fn in case.impls.items():
        with torch.no_grad():
            upstream = torch.randn_like(fn(*inputs))

        def fwd_bwd(fn=fn, upstream=upstream):
            torch.autograd.grad(fn(*inputs), tensors, upstream)

        def fwd(fn=fn):
            with torch.no_grad():
                fn(*inputs)

        result = {"fwd_ms": measure(fwd), "fwd_bwd_ms": measure(fwd_bwd)}
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            result["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        case.results[name] = result


def report(cases: list[Case], ceilings: dict[str, float]) -> list[tuple[str, str, bool]]:
    """Prints the table and returns the targets as (what, measured, passed)."""
    print(f"\nceilings: copy {ceilings['TB/s']:.2f} TB/s, GEMM {ceilings['TFLOP/s']:.0f} TFLOP/s")
    header = f"{'kernel':14} {'shape':26} {'impl':12} {'fwd ms':>9} {'f+b ms':>9}"
    print(header + f" {'fwd rate':>14} {'f+b rate':>14} {'f+b %ceil':>9} {'peak MiB':>9}")
    targets = []
    for case in cases:
        ceiling = ceilings[case.unit]
        for name, r in case.results.items():
            rate_f = case.work_fwd / r["fwd_ms"] / 1e9
            rate_fb = case.work_fwd_bwd / r["fwd_bwd_ms"] / 1e9
            peak = f"{r['peak_mib']:9.0f}" if "peak_mib" in r else f"{'-':>9}"
            print(
                f"{case.kernel:14} {case.shape:26} {name:12} {r['fwd_ms']:9.3f} "
                f"{r['fwd_bwd_ms']:9.3f} {rate_f:8.2f} {case.unit:5} {rate_fb:8.2f} "
                f"{case.unit:5} {100 * rate_fb / ceiling:8.0f}% {peak}"
            )
        targets += case_targets(case, ceiling)
    return targets


def case_targets(case: Case, ceiling: float) -> list[tuple[str, str, bool]]:
    ours, out = case.results["ours"], []
    label = f"{case.kernel} {case.shape}"
    if case.kernel in ("rms_norm", "layer_norm"):
        fraction = case.work_fwd_bwd / ours["fwd_bwd_ms"] / 1e9 / ceiling
        out.append((f"{label}: fwd+bwd >= 85% of copy BW", f"{100 * fraction:.0f}%",
                    fraction >= TARGET_NORM_COPY_FRACTION))  # fmt: skip
    if case.kernel == "attention":
        sdpa = case.results["torch SDPA"]
        fwd = sdpa["fwd_ms"] / ours["fwd_ms"]
        bwd = (sdpa["fwd_bwd_ms"] - sdpa["fwd_ms"]) / (ours["fwd_bwd_ms"] - ours["fwd_ms"])
        out.append((f"{label}: fwd >= 0.9x SDPA", f"{fwd:.2f}x", fwd >= TARGET_ATTN_FWD))
        out.append((f"{label}: bwd >= 0.8x SDPA", f"{bwd:.2f}x", bwd >= TARGET_ATTN_BWD))
    if case.kernel == "cross_entropy":
        for baseline in ("torch eager", "torch layer"):
            speedup = case.results[baseline]["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
            out.append((f"{label}: f+b >= 2x {baseline}", f"{speedup:.2f}x",
                        speedup >= TARGET_CE_SPEEDUP))  # fmt: skip
        if "peak_mib" in ours:
            # The gradient (logits-sized, logits dtype) is unavoidable; an fp32 copy of the
            # logits would add twice as much again on top of it.
            grad_mib = case.work_fwd / 2**20
            out.append((f"{label}: no fp32 logits copy (peak - grad)",
                        f"{ours['peak_mib'] - grad_mib:.0f} MiB",
                        ours["peak_mib"] < 2 * grad_mib))  # fmt: skip
    return out


def check_kernels(device: str) -> bool:
    """Every kernel once at small odd shapes in fp32 against the torch reference (output and
    gradients); prints the largest differences and returns whether all are within 1e-4."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_(True)

    target = torch.randint(0, 67, (7,), generator=gen).to(device)
    target[2] = -100
    checks = {
        "rms_norm": (kernels.rms_norm, reference.rms_norm, [rand(5, 37), rand(37), 1e-5]),
        "layer_norm": (kernels.layer_norm, reference.layer_norm,
                       [rand(5, 37), rand(37), rand(37), 1e-5]),
        "rope": (triton_rope, reference.rope, [rand(1, 2, 13, 16)]),
        "swiglu": (kernels.swiglu, reference.swiglu, [rand(5, 37), rand(5, 37)]),
        "bias_gelu": (kernels.bias_gelu, reference.bias_gelu, [rand(5, 37), rand(37)]),
        "attention": (kernels.attention, reference.attention,
                      [rand(1, 4, 21, 16), rand(1, 2, 21, 16), rand(1, 2, 21, 16), True]),
        "cross_entropy": (lambda x, t: kernels.cross_entropy(x, t, None), f_cross_entropy,
                          [rand(7, 67), target]),
    }  # fmt: skip
    ok = True
    for name, (ours, ref, inputs) in checks.items():
        tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        got, want = ours(*inputs), ref(*inputs)
        upstream = torch.randn(got.shape, generator=gen).to(device)
        grads = torch.autograd.grad(got, tensors, upstream)
        ref_grads = torch.autograd.grad(want, tensors, upstream)
        errors = [(got - want).abs().max().item()]
        errors += [(a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True)]
        passed = max(errors) <= 1e-4
        ok &= passed
        shown = ", ".join(f"{e:.1e}" for e in errors)
        print(
            f"  {name:14} max |ours - torch| output, grads: {shown}  {'ok' if passed else 'FAIL'}"
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check correctness")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before timing")
    parser.add_argument("--iters", type=int, default=20, help="timed runs (median is reported)")
    args = parser.parse_args(argv)
    device = "cuda" if CUDA else "cpu"
    if not CUDA:
        print("CUDA is not available: no timings on this machine. The kernels run under Triton's")
        print("interpreter (TRITON_INTERPRET=1) to check them against the torch reference.")
    print(f"correctness at small shapes ({device}, fp32):")
    ok = check_kernels(device)
    if args.check or not ok:
        return 0 if ok else 1
    if CUDA:
        cases, measure = (
            build_cases("cuda", torch.bfloat16, tiny=False),
            timer("cuda", args.warmup, args.iters),
        )
        print(f"\ndevice: {torch.cuda.get_device_name()}, bf16, median of {args.iters} runs")
    else:
        print("\ndry run of the benchmark at tiny shapes (interpreter: NOT performance numbers):")
        cases, measure = build_cases("cpu", torch.float32, tiny=True), timer("cpu", 0, 1)
    ceilings = measure_ceilings(device, tiny=not CUDA, measure=measure)
    for case in cases:
        run_case(case, device, measure)
    targets = report(cases, ceilings)
    width = max(len(what) for what, _, _ in targets)
    print(f"\n{'target':{width}} {'measured':>10} result")
    for what, measured, passed in targets:
        print(f"{what:{width}} {measured:>10} {'pass' if passed else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
