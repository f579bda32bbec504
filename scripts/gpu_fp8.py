"""The fp8 phase of scripts/gpu_check.py (its section "fp8"), loaded by it as a module.

1. GEMM: X [M, K] W [N, K]^T at a llama3-8b size (bf16 operands, cast by our fused kernels):
   our blockwise fp8 GEMM, torch._scaled_mm on the same operands cast tensorwise and rowwise,
   and the bf16 GEMM: TFLOP/s (ref: bf16's) and the largest error against the fp32 product,
   relative to its largest magnitude (FAIL beyond the fp8 bound: each product within
   2 * 2^-4 of exact, e4m3 keeping 3 mantissa bits, so the error within 2^-3 of sum |x w|).
   On the way, the casts on the GPU against megatronish.fp8's on the CPU, bit for bit.
2. Training: `megatronish train` of configs/tiny.yaml for a few steps in bf16 and in fp8 by
   each recipe; every fp8 loss against bf16's at the same step (FAIL beyond 2%).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SECTION = "fp8"
FP8_GEMM = (8192, 4096, 4096)  # M (tokens), K (in), N (out): llama3-8b's attention output
FP8_ERROR_BOUND = 2.0**-3  # relative to max sum |x w|: two e4m3 roundings of 2^-4 each
RECIPES = ("tensorwise", "rowwise", "blockwise")
TRAIN_CONFIG, TRAIN_STEPS = "tiny", 20
LOSS_GAP = 0.02  # the largest relative gap of an fp8 loss from bf16's at the same step

Row = dict[str, Any]


def _row(name: str, what: str, ours, reference, unit: str, status: str = "ok") -> Row:
    return {
        "section": SECTION,
        "name": name,
        "what": what,
        "ours": ours,
        "reference": reference,
        "unit": unit,
        "status": status,
    }


def gemm_rows(name: str, figures: dict[str, float], bf16: dict[str, float]) -> list[Row]:
    """The rows of one GEMM: TFLOP/s next to bf16's, the error against fp32 next to bf16's
    (FAIL above the bound, relative to the error's own scale: figures["bound"]), and, where
    it ran on the same operands as _scaled_mm, its difference from _scaled_mm's output."""
    status = "ok" if figures["error"] <= figures["bound"] else "FAIL: beyond the fp8 bound"
    rows = [
        _row(name, "throughput (ref: bf16)", figures["tflops"], bf16["tflops"], "TFLOP/s"),
        _row(
            name, "max error vs fp32 (ref: bf16's)", figures["error"], bf16["error"], "abs", status
        ),
    ]
    if "cast_equal" in figures:
        equal = "equal" if figures["cast_equal"] else "differ"
        status = "ok" if equal == "equal" else "FAIL: the fused cast differs from megatronish.fp8's"
        rows.append(_row(name, "casts vs the CPU path, bit for bit", equal, "equal", "", status))
    return rows


def _casts_equal(x, granularity: str, dtype, power_of_2: bool, payload, scale) -> bool:
    """Whether payload and scale (our kernels', on the GPU) are megatronish.fp8's on the CPU."""
    import torch

    from megatronish.fp8 import granularity as groups
    from megatronish.fp8.scaling import amax_to_scale, cast_to_fp8

    x = x.cpu()
    want_scale = amax_to_scale(groups.amax(x, granularity), dtype, power_of_2)
    want = cast_to_fp8(x, groups.expand(want_scale, granularity, x.shape), dtype)
    same_payload = torch.equal(payload.cpu().view(torch.uint8), want.view(torch.uint8))
    return same_payload and torch.equal(scale.cpu().reshape(want_scale.shape), want_scale)


def fp8_gemm_job(
    device: str, measure: Callable, shape: tuple[int, int, int] = FP8_GEMM
) -> Callable[[float], tuple[list[Row], dict]]:
    """The GEMM checks (1. in the module) at shape (M, K, N); on the CPU (no _scaled_mm, and
    the kernels under Triton's interpreter) only ours and the product in fp32."""

    def run(_timeout: float) -> tuple[list[Row], dict]:
        import torch
        import torch.nn.functional as F
        from megatronish_kernels import functions as kernels

        m, k, n = shape
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        w = (torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5).float()
        exact = torch.mm(x.float(), w.t())
        scale = exact.abs().max().item()
        magnitude = torch.mm(x.float().abs(), w.abs().t()).max().item() / scale
        flops = 2 * m * n * k

        def figures(fn, ms=None) -> dict[str, float]:
            ms = measure(fn) if ms is None else ms
            error = (fn().float() - exact).abs().max().item() / scale
            return {"ms": ms, "tflops": flops / ms / 1e9, "error": error}

        e4m3 = torch.float8_e4m3fn
        bf16 = figures(lambda: F.linear(x, w.to(dtype)))
        results = {}
        qx, sx = kernels.fp8_cast(x, "tile", e4m3)
        qw, sw = kernels.fp8_cast(w, "block", e4m3)
        results["blockwise (ours)"] = {
            **figures(lambda: kernels.fp8_gemm(qx, qw, sx, sw, dtype, b_block=True)),
            "cast_equal": _casts_equal(x, "tile", e4m3, False, qx, sx)
            and _casts_equal(w, "block", e4m3, False, qw, sw),
        }
        for recipe, granularity, power_of_2 in (
            ("tensorwise", "tensor", False),
            ("rowwise", "row", True),
        ):
            qx, sx = kernels.fp8_cast(x, granularity, e4m3, power_of_2)
            qw, sw = kernels.fp8_cast(w, granularity, e4m3, power_of_2)
            ours = figures(lambda a=qx, b=qw, sa=sx, sb=sw: kernels.fp8_gemm(a, b, sa, sb, dtype))
            ours["cast_equal"] = _casts_equal(x, granularity, e4m3, power_of_2, qx, sx)
            results[f"{recipe} (ours)"] = ours
            if device == "cuda":
                scale_w = sw.reciprocal() if granularity == "tensor" else sw.reciprocal().t()

                def scaled_mm(qx=qx, qw=qw, sx=sx, scale_w=scale_w):
                    return torch._scaled_mm(
                        qx, qw.t(), scale_a=sx.reciprocal(), scale_b=scale_w, out_dtype=dtype
                    )

                results[f"{recipe} (torch._scaled_mm)"] = figures(scaled_mm)
        rows = []
        for what, found in results.items():
            found["bound"] = FP8_ERROR_BOUND * magnitude
            rows += gemm_rows(f"GEMM {m}x{n}x{k} {what}", found, bf16)
        return rows, {"shape": list(shape), "bf16": bf16, **results}

    return run


def loss_rows(name: str, losses: list[float], bf16: list[float]) -> list[Row]:
    """An fp8 run's final loss next to bf16's, and its largest relative gap from bf16's at the
    same step (FAIL above LOSS_GAP, or when the runs logged different steps)."""
    if len(losses) != len(bf16) or not losses:
        status = f"FAIL: {len(losses)} logged steps, bf16 logged {len(bf16)}"
        return [_row(name, "final loss (ref: bf16)", None, None, "", status)]
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, bf16))
    status = "ok" if gap <= LOSS_GAP else f"FAIL: over {100 * LOSS_GAP:.0f}% from bf16"
    return [
        _row(name, "final loss (ref: bf16)", losses[-1], bf16[-1], ""),
        _row(name, "largest gap from bf16 at a step", 100 * gap, 100 * LOSS_GAP, "%", status),
    ]


def _train_losses(run_command: Callable, precision: list[str], timeout: float) -> list[float]:
    """The logged training losses of configs/TRAIN_CONFIG.yaml for TRAIN_STEPS steps."""
    with tempfile.TemporaryDirectory(prefix="gpu_check-fp8-") as out_dir:
        command = [sys.executable, "-m", "megatronish", "train", "--config"]
        command.append(str(REPO / "configs" / f"{TRAIN_CONFIG}.yaml"))
        sets = [f"train.steps={TRAIN_STEPS}", "train.log_every=1", "train.warmup_steps=5"]
        sets += [f"train.eval_every={TRAIN_STEPS}", f"run.out_dir={out_dir}", *precision]
        for item in sets:
            command += ["--set", item]
        done = run_command(command, timeout)
        if done.timed_out or done.returncode != 0:
            raise RuntimeError(f"train {' '.join(precision)}: exit {done.returncode}")
        lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


def fp8_training_job(
    run_command: Callable, recipes: tuple[str, ...] = RECIPES
) -> Callable[[float], tuple[list[Row], dict]]:
    """The training check (2. in the module): bf16, then each recipe, each run given a share of
    the timeout."""

    def run(timeout: float) -> tuple[list[Row], dict]:
        share = timeout / (len(recipes) + 1)
        bf16 = _train_losses(run_command, ["train.precision=bf16"], share)
        rows, detail = [], {"bf16": bf16}
        for recipe in recipes:
            sets = ["train.precision=fp8", f"train.fp8_recipe={recipe}"]
            losses = _train_losses(run_command, sets, share)
            detail[recipe] = losses
            rows += loss_rows(f"{TRAIN_CONFIG} {TRAIN_STEPS} steps fp8 {recipe}", losses, bf16)
        return rows, detail

    return run
