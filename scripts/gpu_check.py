"""Every GPU figure of the project from one command, as one markdown table and a JSON record.

The CUDA tests, every Triton kernel against torch, and bf16 training throughput, in minutes.

    python scripts/gpu_check.py [--json gpu_check.json] [--quick]
    python scripts/gpu_check.py --from-json gpu_check.json   # the table again, runs nothing

On a machine with one or more CUDA GPUs it runs, in this order:

1. tests: `pytest -m cuda -q` in a subprocess (at most 180 s); the passed, failed and skipped
   counts of pytest's closing line.
2. device: GPU 0's copy bandwidth and bf16 GEMM rate (scripts/bench_kernels.py's ceilings), the
   GEMM next to the GPU's dense bf16 peak.
3. kernels: every Triton kernel against its torch counterpart, bf16, at the first realistic
   shape scripts/bench_kernels.py plans for it: attention against torch SDPA (causal, 32 query
   and 8 key/value heads, sequence 2048, head dim 128), rms_norm, layer_norm, rope, swiglu,
   bias_gelu, cross entropy over a 50k vocabulary, and the grouped GEMM when megatronish_kernels
   has one (`grouped_mm(x [t, k], w [g, k, n], offsets [g])`, offsets the int32 end row of each
   group, as torch._grouped_mm takes them). For each: forward and forward+backward time (median
   of CUDA-event timings after warm-up, bench_kernels.py's timer), the achieved TB/s (memory-
   bound ops) or TFLOP/s (attention, GEMM), and the largest absolute error of the output and of
   the input gradients against the torch op on float64 copies of the same bf16 inputs (rms_norm
   and rope compute in fp32 inside), next to torch bf16's own error. Ours passes within
   2 x torch's error + 0.02, the bound of tests/kernels/test_kernels.py. Then attention over
   sequences of 2048 tokens packed with documents of 128 (document masks,
   scripts/bench_packed_attention.py) next to our causal attention of the same length: both
   times, the packed / causal ratio of
   forward+backward next to the share of causal's FLOPs the kernels walk for this GPU's tiles,
   and the packed output's error against float64, ours next to torch SDPA's with the mask.
4. compile: every kernel at scripts/kernel_report.py's representative configuration, compiled
   for GPU 0's arch (sm_80 or sm_90) and loaded by the CUDA driver: the registers, local memory
   (spill bytes), shared memory per block (static + dynamic) and warps per SM (the driver's
   occupancy calculator) the driver reports, next to what kernel_report reads from the same
   cubin (cuobjdump) and estimates. A figure that differs FAILs: the report computed without a
   GPU is wrong there.
5. training: `megatronish bench` of gpt2-124m and gpt2-1.3b in bf16 at tp = 1, and at tp = 2
   when two GPUs are present, one micro-batch per step, 5 timed steps after 2 warm-up: tokens/s,
   MFU, step time and peak memory (next to plan's estimate). A run that fails (out of memory,
   say) or runs past its 150 s is a row that says so.
6. calibration: GPU 0's bf16 GEMM time at every linear's shape of the shipped configs
   (accounting.device_file), and the 8192^3 GEMM in fp8 (torch._scaled_mm, e4m3, where the GPU
   has fp8), turned into the device file `megatronish plan --gpu FILE` reads (--device-file,
   default gpu_check_device.yaml): the datasheet's figures with the measured large-GEMM
   fraction and fp8 peak; one row per figure, next to the datasheet's.
7. tp-overlap (parallel.tp_comm_overlap): on GPU 0, a row-parallel GEMM of gpt2-1.3b's size
   (bf16, [4, 2048, 4096] x [4096, 4096]) computed as the decomposition computes it, in t = 2
   and 8 sequence chunks one after another, next to the whole GEMM: the time the split costs,
   and its largest difference from the whole GEMM's output (ok within one bf16 rounding of the
   output's largest magnitude). With two GPUs also `megatronish bench` of gpt2-124m in bf16 at
   tp = 2 with sequence parallelism, the tp collectives decomposed and not: step time and rank
   0's exposed tensor-parallel wait, each next to the run without.
7. fp8 (scripts/gpu_fp8.py; on sm_89 and newer): a llama3-8b-sized GEMM through our fused
   casts and blockwise fp8 GEMM, and through torch._scaled_mm tensorwise and rowwise, next to
   bf16 (TFLOP/s, largest error against fp32 within the fp8 bound, the casts bit for bit with
   the CPU path); then configs/tiny.yaml trained 20 steps in bf16 and in fp8 by each recipe
   (--quick: blockwise), every fp8 loss within 2% of bf16's at the same step.

It prints one markdown table (a row per figure: section, name, what, ours, torch / reference,
unit, status), writes every result with the GPU names, the torch, Triton and CUDA versions and
the wall time as JSON, and exits 0 when no row failed, 1 otherwise. It takes about 3 minutes on
one H100 or H200 and under 8: every phase has a time limit, every subprocess a timeout (the
kernel checks run in this process, seconds each, between which the limits are checked), and
after 7.5 minutes nothing new starts (the rows left say "skipped: time budget"). --quick
times fewer iterations and steps and trains gpt2-124m only (about 2 minutes). Without a CUDA GPU
it exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: --from-json runs without it
    import torch

REPO = Path(__file__).resolve().parents[1]
NO_GPU = (
    "gpu_check: no CUDA GPU found (torch.cuda.is_available() is False); "
    "run it on a machine with an NVIDIA GPU"
)
BUDGET_S = 450.0  # nothing new starts after 7.5 minutes
HARD_S = 470.0  # no subprocess runs past this
PHASE_LIMITS_S = {
    "tests": 180.0,
    "device": 30.0,
    "kernels": 150.0,
    "compile": 90.0,
    "training": 300.0,
    "calibration": 60.0,
    "tp-overlap": 150.0,
    "fp8": 240.0,
}
DEVICE_FILE = Path("gpu_check_device.yaml")  # the calibrated device file (--device-file)
TRAIN_RUN_S = 150.0  # one `megatronish bench` run
TRAIN_CONFIGS = ("gpt2-124m", "gpt2-1.3b")
TORCH_COUNTERPART = {"attention": "torch SDPA"}  # every other kernel: "torch eager"
ERROR_FACTOR, ERROR_FLOOR = 2.0, 2e-2
PACKED = (2048, 128)  # sequence and document length of the packed-attention check
SINGULAR = {"errors": "error", "warnings": "warning"}  # in pytest's closing line
COLUMNS = ("section", "name", "what", "ours", "torch / reference", "unit", "status")
FORMATS = {
    "ms": "{:.3f}",
    "s": "{:.3f}",
    "TB/s": "{:.2f}",
    "TFLOP/s": "{:.1f}",
    "tokens/s": "{:,.0f}",
    "%": "{:.1f}",
    "GB": "{:.2f}",
    "abs": "{:.2e}",
}

Row = dict[str, Any]
Outcome = tuple[list[Row], dict[str, Any]]


def row(
    section: str,
    name: str,
    what: str,
    ours: float | str | None,
    reference: float | str | None,
    unit: str,
    status: str = "ok",
) -> Row:
    """One line of the table. status: "ok", "FAIL: ..." (a figure out of bounds), "failed: ..."
    (the check did not run to the end) or "skipped: ..."."""
    return {
        "section": section,
        "name": name,
        "what": what,
        "ours": ours,
        "reference": reference,
        "unit": unit,
        "status": status,
    }


# --------------------------------------------------------------------------------------------
# The table


def format_value(value: float | str | None, unit: str) -> str:
    """A cell: "-" for None, text as it is, a number by its unit: ms and s 3 decimals, TB/s 2,
    TFLOP/s 1, tokens/s whole with thousands separators, % 1 decimal, GB 2, abs errors in
    scientific notation with 3 digits (7.81e-03); other units as %g does."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return FORMATS.get(unit, "{:g}").format(value)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def title(results: dict) -> str:
    """The line above the table: the GPUs, the versions and the wall time."""
    gpus = Counter(gpu["name"] for gpu in results.get("gpus", []))
    devices = ", ".join(f"{count} x {name}" for name, count in gpus.items()) or "no GPU"
    v = results.get("versions", {})
    quick = " (--quick)" if results.get("quick") else ""
    return (
        f"gpu_check on {devices}: torch {v.get('torch', '?')}, triton {v.get('triton', '?')}, "
        f"CUDA {v.get('cuda', '?')}; {results.get('wall_s', 0.0):.0f} s{quick}"
    )


def render(results: dict) -> str:
    """The title line, a blank line and the markdown table of results["rows"] (a row per
    figure, cells as `format_value` writes them, the number columns right-aligned)."""
    align = ["---", "---", "---", "---:", "---:", "---", "---"]
    lines = [title(results), "", f"| {' | '.join(COLUMNS)} |", f"|{'|'.join(align)}|"]
    for r in results["rows"]:
        cells = [
            r["section"],
            r["name"],
            r["what"],
            format_value(r["ours"], r["unit"]),
            format_value(r["reference"], r["unit"]),
            r["unit"],
            r["status"],
        ]
        lines.append(f"| {' | '.join(_cell(c) for c in cells)} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Time budget and jobs


class Clock:
    """Seconds since the start; after budget_s no job starts, and no subprocess runs past
    hard_s."""

    def __init__(self, budget_s: float = BUDGET_S, hard_s: float = HARD_S) -> None:
        self.start, self.budget_s, self.hard_s = time.monotonic(), budget_s, hard_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def hard_left(self) -> float:
        return self.hard_s - self.elapsed()


@dataclass
class Job:
    """One unit of work: run(timeout_s) gives its rows and a detail record for the JSON."""

    section: str
    name: str
    run: Callable[[float], Outcome]
    limit_s: float = float("inf")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def run_jobs(
    jobs: list[Job],
    clock: Clock,
    phase_limits: dict[str, float] = PHASE_LIMITS_S,
    progress: Callable[[str], None] = lambda line: None,
) -> tuple[list[Row], dict[str, list[dict]]]:
    """Runs the jobs in order, each with the timeout its own limit, its phase's (section's)
    time left and the hard limit allow. A job that would start after the budget, or after its
    phase's time is up, becomes a skipped row; one that raises, a failed row. Returns the rows
    and the detail records by section."""
    rows: list[Row] = []
    details: dict[str, list[dict]] = {}
    phase_start: dict[str, float] = {}
    for job in jobs:
        now = clock.elapsed()
        start = phase_start.setdefault(job.section, now)
        phase_left = phase_limits.get(job.section, float("inf")) - (now - start)
        detail: dict[str, Any] = {}
        if now >= clock.budget_s:
            new_rows = [row(job.section, job.name, "-", None, None, "", "skipped: time budget")]
        elif phase_left <= 0:
            limit = phase_limits[job.section]
            status = f"skipped: {job.section} phase limit ({limit:.0f} s)"
            new_rows = [row(job.section, job.name, "-", None, None, "", status)]
        else:
            progress(f"[{now:5.0f} s] {job.section}: {job.name}")
            try:
                new_rows, detail = job.run(min(job.limit_s, phase_left, clock.hard_left()))
            except Exception as exc:  # an out-of-memory error, a kernel that does not compile
                status = f"failed: {_first_line(exc)}"
                new_rows = [row(job.section, job.name, "-", None, None, "", status)]
                detail = {"error": status}
        detail = {"name": job.name, **detail, "status": [r["status"] for r in new_rows]}
        rows += new_rows
        details.setdefault(job.section, []).append(detail)
    return rows, details


# --------------------------------------------------------------------------------------------
# Subprocesses


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool


def _descendants(root: int) -> list[int]:
    """Every process below root (from /proc): torchrun starts its ranks in sessions of their
    own, so killing root's process group would not reach them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def run_command(command: list[str], timeout: float) -> Finished:
    """command from the repository root; after timeout s it and every process it started are
    killed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    return Finished(proc.returncode, stdout, stderr, time.monotonic() - start, timed_out)


def error_line(text: str) -> str:
    """The line of a failed command's output that names its error (the last one that looks
    like `SomeError: ...`), else its last non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", line):
            return line[:160]
    return lines[-1][:160] if lines else "no output"


def parse_pytest_summary(output: str) -> dict[str, int] | None:
    """The counts of pytest's closing line ("3 passed, 1 failed, 2 skipped, 9 deselected in
    4.1s"), keyed passed, failed, skipped, error, deselected, ... (plurals made singular);
    None when there is no such line."""
    for line in reversed(output.strip().splitlines()):
        if re.search(r"\bin \d+(\.\d+)?s\b", line):
            counts = re.findall(r"(\d+) ([a-z]+)", line)
            return {SINGULAR.get(word, word): int(n) for n, word in counts}
    return None


def pytest_job(timeout: float) -> Outcome:
    """`pytest -m cuda -q`: one row, passed / failed / skipped."""
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q"]
    done = run_command(command, timeout)
    counts = parse_pytest_summary(done.stdout) or {}
    passed, failed, skipped, errors = (
        counts.get(k, 0) for k in ("passed", "failed", "skipped", "error")
    )
    if done.timed_out:
        status = f"failed: timeout after {timeout:.0f} s"
    elif not counts:
        status = f"failed: exit {done.returncode}: {error_line(done.stdout + done.stderr)}"
    elif failed or errors:
        status = f"FAIL: {failed} failed, {errors} errors"
    elif passed == 0:
        status = "FAIL: no CUDA test ran"
    else:
        status = "ok"
    detail = {
        "name": "pytest -m cuda",
        "command": command,
        "returncode": done.returncode,
        "wall_s": done.wall_s,
        "counts": counts,
        "timed_out": done.timed_out,
    }
    if status != "ok":
        detail["output_tail"] = (done.stdout + done.stderr)[-4000:]
    ours = f"{passed} / {failed} / {skipped}"
    return [
        row("tests", "pytest -m cuda", "passed / failed / skipped", ours, None, "tests", status)
    ], detail


# --------------------------------------------------------------------------------------------
# Training throughput


def bench_record(
    config: Path, tp: int, steps: int, warmup: int, sets: list[str], timeout: float
) -> tuple[dict | None, str, dict[str, Any]]:
    """`megatronish bench` of config in bf16 at tp, one micro-batch per optimizer step, with
    `sets` as extra settings (the bench command starts tp processes through torchrun when
    tp > 1): (its JSON record or None, the status, the detail for the JSON)."""
    from megatronish.config import load_config

    micro = load_config(config).train.micro_batch_size
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as out_dir:
        command = [
            sys.executable,
            "-m",
            "megatronish",
            "bench",
            "--config",
            str(config),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
        ]
        for item in (
            "train.precision=bf16",
            f"parallel.tp={tp}",
            f"train.global_batch_size={micro}",
            f"run.out_dir={out_dir}",
            *sets,
        ):
            command += ["--set", item]
        done = run_command(command, timeout)
    detail: dict[str, Any] = {
        "config": config.name,
        "tp": tp,
        "command": command,
        "returncode": done.returncode,
        "wall_s": done.wall_s,
    }
    record = None
    if done.timed_out:
        status = f"failed: timeout after {timeout:.0f} s"
    elif done.returncode != 0:
        status = f"failed: exit {done.returncode}: {error_line(done.stderr + done.stdout)}"
    else:
        try:
            record = json.loads(done.stdout.strip().splitlines()[-1])
            status = "ok"
        except (IndexError, ValueError):
            status = "failed: no JSON line at the end of its output"
    if record is None:
        detail["output_tail"] = (done.stdout + done.stderr)[-4000:]
    else:
        detail["record"] = record
    return record, status, detail


def bench_job(config: Path, tp: int, steps: int, warmup: int) -> Callable[[float], Outcome]:
    """`megatronish bench` of config in bf16 at tp (bench_record): throughput, MFU, step time
    and peak memory next to plan's estimate."""

    def run(timeout: float) -> Outcome:
        name = f"{config.stem} tp{tp}"
        record, status, detail = bench_record(config, tp, steps, warmup, [], timeout)
        detail = {"name": name, **detail}
        if record is None:
            return [row("training", name, "throughput", None, None, "tokens/s", status)], detail
        return [
            row("training", name, "throughput", record["tokens_per_s"], None, "tokens/s"),
            row("training", name, "MFU", 100 * record["mfu"], None, "%"),
            row("training", name, "step time", record["step_time_s"], None, "s"),
            row(
                "training",
                name,
                "peak memory (ref: plan's estimate)",
                record.get("peak_memory_gb"),
                record.get("plan_memory_gb"),
                "GB",
            ),
        ], detail

    return run


def training_jobs(configs: list[str], gpu_count: int, steps: int, warmup: int) -> list[Job]:
    """Every config at tp = 1, then at tp = 2 (a skipped row with one GPU)."""
    jobs = []
    for tp in (1, 2):
        for name in configs:
            config = REPO / "configs" / f"{name}.yaml"
            if tp <= gpu_count:
                jobs.append(
                    Job(
                        "training",
                        f"{name} tp{tp}",
                        bench_job(config, tp, steps, warmup),
                        TRAIN_RUN_S,
                    )
                )
            else:
                skipped = row(
                    "training",
                    f"{name} tp{tp}",
                    "throughput",
                    None,
                    None,
                    "tokens/s",
                    f"skipped: needs {tp} GPUs",
                )
                jobs.append(Job("training", f"{name} tp{tp}", lambda _t, r=skipped: ([r], {})))
    return jobs


# --------------------------------------------------------------------------------------------
# Tensor-parallel communication under the GEMMs (parallel.tp_comm_overlap)

SPLIT_GEMM = (4, 2048, 4096, 4096)  # b, s, in, out: gpt2-1.3b's MLP down at tp 2
SPLIT_CHUNKS = (2, 8)
OVERLAP_CONFIG = "gpt2-124m"


def split_gemm_rows(t: int, split_ms: float, whole_ms: float, error: float, bound: float):
    """The rows of the GEMM in t sequence chunks: its time next to the whole GEMM's, and its
    largest difference from the whole GEMM's output next to the bound (FAIL above it)."""
    name = f"GEMM {'x'.join(map(str, SPLIT_GEMM))} in {t} chunks"
    status = "ok" if error <= bound else "FAIL: beyond one rounding of the output"
    return [
        row("tp-overlap", name, "time (ref: whole GEMM)", split_ms, whole_ms, "ms"),
        row("tp-overlap", name, "max difference (ref: one rounding)", error, bound, "abs", status),
    ]


def split_gemm_job(
    device: str, measure: Callable, shape: tuple[int, ...] = SPLIT_GEMM
) -> Callable[[float], Outcome]:
    """x [b, s, in] times w [out, in] (bf16 on CUDA, fp32 elsewhere) in t sequence chunks one
    after another, as megatronish.layers.overlap computes a row-parallel GEMM (each chunk's
    product then travels while the next computes), against the whole GEMM. The bound: one
    rounding of the output's dtype at its largest magnitude (eps x max |whole|), since each
    output element is one dot product either way, accumulated in fp32."""

    def run(_timeout: float) -> Outcome:
        import torch
        import torch.nn.functional as F

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        b, s, k, n = shape
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(b, s, k, device=device, dtype=dtype, generator=gen)
        w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5
        whole = F.linear(x, w).float()
        whole_ms = measure(lambda: F.linear(x, w))
        bound = torch.finfo(dtype).eps * whole.abs().max().item()
        rows, detail = [], {"shape": list(shape), "whole_ms": whole_ms, "bound": bound}
        for t in SPLIT_CHUNKS:

            def split(t: int = t) -> list:
                return [F.linear(chunk, w) for chunk in x.chunk(t, dim=1)]

            error = (torch.cat(split(), dim=1).float() - whole).abs().max().item()
            split_ms = measure(split)
            rows += split_gemm_rows(t, split_ms, whole_ms, error, bound)
            detail[f"chunks_{t}"] = {"ms": split_ms, "max_difference": error}
        return rows, detail

    return run


def overlap_bench_job(steps: int, warmup: int) -> Callable[[float], Outcome]:
    """OVERLAP_CONFIG at tp = 2 with sequence parallelism (bench_record), the tp collectives
    decomposed under the GEMMs and not: step time and rank 0's exposed tp wait, each next to
    the run without."""

    def run(timeout: float) -> Outcome:
        config, name = REPO / "configs" / f"{OVERLAP_CONFIG}.yaml", f"{OVERLAP_CONFIG} tp2 sp"
        records, details = {}, {}
        for on in ("true", "false"):
            sets = ["parallel.sequence_parallel=true", f"parallel.tp_comm_overlap={on}"]
            record, status, details[on] = bench_record(config, 2, steps, warmup, sets, timeout / 2)
            if record is None:
                what = f"tp_comm_overlap={on}"
                return [row("tp-overlap", name, what, None, None, "s", status)], details
            records[on] = record
        on, off = records["true"], records["false"]
        step = "step time, overlap (ref: without)"
        wait = "rank 0 exposed tp wait, overlap (ref: without)"
        return [
            row("tp-overlap", name, step, on["step_time_s"], off["step_time_s"], "s"),
            row(
                "tp-overlap",
                name,
                wait,
                1e3 * on["exposed_tp_wait_s"],
                1e3 * off["exposed_tp_wait_s"],
                "ms",
            ),
        ], details

    return run


# --------------------------------------------------------------------------------------------
# Kernels


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load_bench_kernels() -> ModuleType:
    """scripts/bench_kernels.py as a module (it imports the Triton kernels)."""
    return load_script("bench_kernels")


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM in torch: rows offsets[g - 1]:offsets[g] of x times w[g]."""
    import torch

    starts = [0, *offsets.tolist()]
    return torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, starts[1:]))])


def kernel_cases(bk: ModuleType, device: str, dtype: torch.dtype, tiny: bool) -> list:
    """One bench_kernels Case per kernel: the first shape it plans (attention
    b4 h32/kv8 s2048 d128, cross entropy 8192 x 50304 at tp 1), with only "ours" and "torch"
    (its counterpart) to time; then the grouped GEMM when the kernels have one."""
    cases, seen = [], set()
    for case in bk.build_cases(device, dtype, tiny):
        if case.kernel not in seen:
            seen.add(case.kernel)
            counterpart = case.impls[TORCH_COUNTERPART.get(case.kernel, "torch eager")]
            impls = {"torch": counterpart, "ours": case.impls["ours"]}
            cases.append(dataclasses.replace(case, impls=impls, results={}))
    grouped = getattr(bk.kernels, "grouped_mm", None)
    if grouped is not None:
        import torch

        groups, tokens, k, n = (2, 24, 16, 8) if tiny else (8, 8192, 4096, 4096)
        ends = torch.arange(1, groups + 1, dtype=torch.int32, device=device) * (tokens // groups)

        def make():
            return [
                bk.leaf(tokens, k, dtype=dtype, device=device),
                bk.leaf(groups, k, n, dtype=dtype, device=device, scale=k**-0.5),
                ends,
            ]

        flops = 2 * tokens * k * n
        cases.append(
            bk.Case(
                "grouped_mm",
                f"g{groups} {tokens}x{k}x{n}",
                make,
                {"torch": grouped_mm_torch, "ours": grouped},
                flops,
                3 * flops,
                "TFLOP/s",
            )
        )
    return cases


def _float64(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().requires_grad_(x.requires_grad)
    return x


def _forward_backward(
    fn: Callable, inputs: list, upstream: torch.Tensor | None = None
) -> tuple[list, torch.Tensor]:
    """[fn(*inputs), the gradient of <fn(*inputs), upstream> for every input that needs one],
    and upstream (a float64 normal draw of the output's shape when not given)."""
    import torch

    out = fn(*inputs)
    if upstream is None:
        upstream = torch.randn(out.shape, dtype=torch.float64, device=out.device)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(out, tensors, upstream.to(out.dtype))
    return [out.detach(), *grads], upstream


def max_errors(case: Any, seed: int = 0) -> dict[str, float]:
    """Largest absolute error of ours and of torch (same inputs, same dtype) against the torch
    op on float64 copies of the inputs: output, and the worst of the input gradients."""
    import torch

    torch.manual_seed(seed)
    inputs = case.make_inputs()
    exact, upstream = _forward_backward(case.impls["torch"], [_float64(x) for x in inputs])
    errors = {}
    for label in ("ours", "torch"):
        got, _ = _forward_backward(case.impls[label], inputs, upstream)
        diffs = [(a.double() - b).abs().max().item() for a, b in zip(got, exact, strict=True)]
        errors[f"{label}_output"], errors[f"{label}_grad"] = diffs[0], max(diffs[1:])
    return errors


def kernel_rows(
    name: str, unit: str, work: tuple[float, float], times: dict, errors: dict[str, float]
) -> list[Row]:
    """The rows of one kernel: forward and forward+backward time and rate (work: bytes or
    FLOPs of each), ours next to torch's, and the errors against float64, ours next to torch
    bf16's (FAIL above 2 x torch's + 0.02)."""
    out = []
    for what, key, amount in (
        ("forward", "fwd_ms", work[0]),
        ("forward+backward", "fwd_bwd_ms", work[1]),
    ):
        ours, theirs = times["ours"][key], times["torch"][key]
        out.append(row("kernels", name, f"{what} time", ours, theirs, "ms"))
        out.append(
            row("kernels", name, f"{what} rate", amount / ours / 1e9, amount / theirs / 1e9, unit)
        )
    for what in ("output", "grad"):
        ours, theirs = errors[f"ours_{what}"], errors[f"torch_{what}"]
        label = "output" if what == "output" else "gradients"
        status = error_status(ours, theirs)
        out.append(row("kernels", name, f"{label} max error vs fp64", ours, theirs, "abs", status))
    return out


def error_status(ours: float, theirs: float) -> str:
    """ok within 2 x torch's error + 0.02 (errors against float64), else FAIL."""
    if ours <= ERROR_FACTOR * theirs + ERROR_FLOOR:
        return "ok"
    return f"FAIL: above {ERROR_FACTOR:g} x torch + {ERROR_FLOOR:g}"


def packed_rows(name: str, result: dict) -> list[Row]:
    """The rows of the packed-attention check (bench_packed_attention.compare's result with
    flops_walked): forward and forward+backward time packed, next to causal; the
    forward+backward time as % of causal's, next to the % of causal's FLOPs the kernels walk;
    the packed output's error against float64, ours next to torch SDPA's."""
    times = result["times"]
    out = [
        row("kernels", name, f"{what} time (ref: causal)", times["packed"][key],
            times["causal"][key], "ms")
        for what, key in (("forward", "fwd_ms"), ("forward+backward", "fwd_bwd_ms"))
    ]  # fmt: skip
    ratio = times["packed"]["fwd_bwd_ms"] / times["causal"]["fwd_bwd_ms"]
    what = "f+b time % of causal (ref: FLOPs walked %)"
    out.append(row("kernels", name, what, 100 * ratio, 100 * result["flops_walked"], "%"))
    ours, theirs = result["errors"]["ours"], result["errors"]["torch"]
    what = "output max error vs fp64 (ref: torch SDPA)"
    out.append(row("kernels", name, what, ours, theirs, "abs", error_status(ours, theirs)))
    return out


def packed_job(measure: Callable) -> Callable[[float], Outcome]:
    """Our attention over sequences packed with documents against our causal attention."""

    def run(_timeout: float) -> Outcome:
        import torch

        packed = load_script("bench_packed_attention")
        seq_len, doc_len = PACKED
        try:
            result = packed.compare(seq_len, doc_len, measure)
        finally:
            torch.cuda.empty_cache()
        major, minor = torch.cuda.get_device_capability(0)
        kernels = packed.walked(seq_len, doc_len, 10 * major + minor)
        result.update(flops_walked=packed.flops_walked(kernels), kernels=kernels)
        name = f"attention {seq_len // doc_len} docs x {doc_len} s{seq_len}"
        return packed_rows(name, result), result

    return run


def kernel_job(
    bk: ModuleType, case: Any, device: str, measure: Callable
) -> Callable[[float], Outcome]:
    """Times one bench_kernels Case (ours and torch) and measures its errors."""

    def run(_timeout: float) -> Outcome:
        import torch

        name = f"{case.kernel} {case.shape}"
        try:
            bk.run_case(case, device, measure)
            errors = max_errors(case)
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        work = (case.work_fwd, case.work_fwd_bwd)
        detail = {
            "name": name,
            "kernel": case.kernel,
            "shape": case.shape,
            "unit": case.unit,
            "work_fwd": work[0],
            "work_fwd_bwd": work[1],
            "results": case.results,
            "errors": errors,
        }
        return kernel_rows(name, case.unit, work, case.results, errors), detail

    return run


def device_job(bk: ModuleType, measure: Callable) -> Callable[[float], Outcome]:
    """Copy bandwidth and bf16 GEMM rate of GPU 0, the GEMM next to its dense bf16 peak."""

    def run(_timeout: float) -> Outcome:
        import torch

        from megatronish.accounting.hardware import GPU_PEAK_TFLOPS

        name = torch.cuda.get_device_name(0)
        try:
            ceilings = bk.measure_ceilings("cuda", tiny=False, measure=measure)
        finally:
            torch.cuda.empty_cache()
        peak = next((v for key, v in GPU_PEAK_TFLOPS.items() if key in name), None)
        return [
            row("device", name, "copy bandwidth (read + write)", ceilings["TB/s"], None, "TB/s"),
            row(
                "device",
                name,
                "bf16 GEMM 8192^3 (ref: dense peak)",
                ceilings["TFLOP/s"],
                peak,
                "TFLOP/s",
            ),
        ], {"name": name, "ceilings": ceilings, "peak_tflops": peak}

    return run


def calibration_rows(base: Any, device: Any, shapes: int, path: Path) -> list[Row]:
    """The calibration's rows: the measured GEMM fraction and fp8 peak next to the datasheet
    device's, and where the device file went."""
    fraction = f"GEMM fraction ({shapes} shapes)"
    fp8, base_fp8 = device.fp8_tflops or None, base.fp8_tflops or None
    return [
        row("calibration", device.name, fraction, device.gemm_fraction, base.gemm_fraction, ""),
        row("calibration", device.name, "fp8 dense peak (model)", fp8, base_fp8, "TFLOP/s"),
        row("calibration", device.name, f"device file: {path}", None, None, ""),
    ]


def calibration_job(
    time_gemm: Callable[[int, int, int, bool], float | None], path: Path
) -> Callable[[float], Outcome]:
    """The calibration phase: time_gemm(m, n, k, fp8) gives the seconds of one GEMM (None: the
    GPU has no fp8); the datasheet device of GPU 0 calibrated by them is written to `path`."""

    def run(_timeout: float) -> Outcome:
        import torch

        from megatronish.accounting.device_file import (
            LARGE,
            calibrated_device,
            shipped_gemm_shapes,
            write_device_file,
        )
        from megatronish.accounting.hardware import GPUS

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100"
        base = next((gpu for key, gpu in GPUS.items() if key in name.upper()), GPUS["H100"])
        shapes = shipped_gemm_shapes(sorted((REPO / "configs").glob("*.yaml")))
        measured = {shape: time_gemm(*shape, False) for shape in shapes}
        device = calibrated_device(base, measured, time_gemm(*LARGE, True))
        write_device_file(device, path)
        rows = calibration_rows(base, device, len(shapes), path)
        return rows, {"device_file": str(path), "gemm_fraction": device.gemm_fraction}

    return run


def cuda_gemm_timer(measure: Callable) -> Callable[[int, int, int, bool], float | None]:
    """Seconds of one [m, k] x [k, n] GEMM on GPU 0 in bf16, or in fp8 (e4m3 operands, bf16
    output, unit scales) by torch._scaled_mm; None for fp8 where the GPU has none."""
    import torch

    def time_gemm(m: int, n: int, k: int, fp8: bool) -> float | None:
        if fp8 and torch.cuda.get_device_capability(0) < (8, 9):
            return None
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        if not fp8:
            return measure(lambda: a @ b.t()) / 1e3
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        return (
            measure(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)) / 1e3
        )

    return time_gemm


# --------------------------------------------------------------------------------------------
# Compiled kernels: what the driver reports next to kernel_report's figures

RESOURCES = ("registers", "spill_bytes", "shared_bytes", "occupancy_warps")
RESOURCES_WHAT = "regs / spill B / shared B / warps per SM (driver vs cubin)"


def driver_resources(kernel: Any) -> dict[str, int]:
    """A kernel compile_check compiled for this GPU's arch, loaded by the CUDA driver (Triton's
    loader, on the current device), as the driver reports it: registers and local memory
    (spill bytes) per thread, static + dynamic shared memory per block, and the warps per SM
    its occupancy calculator allows."""
    import ctypes

    _ = kernel.run  # Triton loads the module on first use (OutOfResources as a launch would)
    cuda = ctypes.CDLL("libcuda.so.1")
    function = ctypes.c_void_p(kernel.function)

    def call(name: str, *args: Any) -> None:
        code = getattr(cuda, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed with CUDA error {code}")

    def attribute(code: int) -> int:  # a CU_FUNC_ATTRIBUTE_*
        value = ctypes.c_int()
        call("cuFuncGetAttribute", ctypes.byref(value), ctypes.c_int(code), function)
        return value.value

    warps, dynamic = kernel.metadata.num_warps, kernel.metadata.shared
    blocks = ctypes.c_int()
    call(
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        ctypes.byref(blocks), function, ctypes.c_int(32 * warps), ctypes.c_size_t(dynamic),
    )  # fmt: skip
    return {
        "registers": attribute(4),  # NUM_REGS
        "spill_bytes": attribute(3),  # LOCAL_SIZE_BYTES
        "shared_bytes": attribute(1) + dynamic,  # SHARED_SIZE_BYTES: the static part
        "occupancy_warps": blocks.value * warps,
    }


def compile_rows(measured: list[dict]) -> list[Row]:
    """A row per compiled kernel: the driver's registers / spill bytes / shared bytes / warps
    per SM next to kernel_report's for the same cubin; FAIL names the figures that differ."""
    rows = []
    for kernel in measured:
        driver, cubin = kernel["driver"], kernel["cubin"]
        differ = [key for key in RESOURCES if driver[key] != cubin[key]]
        status = f"FAIL: {', '.join(differ)} differ" if differ else "ok"
        figures = [" / ".join(str(side[key]) for key in RESOURCES) for side in (driver, cubin)]
        name = f"{kernel['kernel']} {kernel['arch']}"
        rows.append(row("compile", name, RESOURCES_WHAT, *figures, "", status))
    return rows


def compile_job(_timeout: float) -> Outcome:
    """Every kernel at kernel_report's representative configuration compiled for GPU 0's arch
    and loaded by the driver, its figures next to the cubin's."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    arch_name = f"sm_{major}{minor}"
    report = load_script("kernel_report")
    check = report.compile_check
    if arch_name not in check.ARCHS:
        status = f"skipped: kernel_report has no limits for {arch_name}"
        return [row("compile", arch_name, "-", None, None, "", status)], {}
    arch = check.ARCHS[arch_name]
    jobs, _ = report.plan([arch_name], representative=True)
    measured = []
    for _, (_, launch) in jobs:
        kernel = check.compile_launch(launch, arch)
        cubin = check.measure(kernel, launch, arch)
        measured.append(
            {
                "kernel": launch.name,
                "config": cubin.config,
                "arch": arch_name,
                "cubin": {key: getattr(cubin, key) for key in RESOURCES},
                "driver": driver_resources(kernel),
            }
        )
    return compile_rows(measured), {"kernels": measured}


# --------------------------------------------------------------------------------------------
# The driver


def environment() -> dict[str, Any]:
    """The GPUs and the versions (torch, Triton, CUDA, Python)."""
    import torch
    import triton

    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "name": props.name,
                "memory_gb": props.total_memory / 2**30,
                "capability": f"{props.major}.{props.minor}",
            }
        )
    versions = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    return {"gpus": gpus, "versions": versions}


def plan_jobs(quick: bool, gpu_count: int, device_file: Path = DEVICE_FILE) -> list[Job]:
    """Tests, device ceilings, kernels, compiled kernels, training, calibration, tp-overlap, fp8,
    in that order."""
    import torch

    bk = load_bench_kernels()
    measure = bk.timer("cuda", *((2, 5) if quick else (5, 20)))
    jobs = [
        Job("tests", "pytest -m cuda", pytest_job),
        Job("device", "ceilings", device_job(bk, measure)),
    ]
    for case in kernel_cases(bk, "cuda", torch.bfloat16, tiny=False):
        jobs.append(
            Job("kernels", f"{case.kernel} {case.shape}", kernel_job(bk, case, "cuda", measure))
        )
    jobs.append(Job("kernels", "attention packed with documents", packed_job(measure)))
    if not hasattr(bk.kernels, "grouped_mm"):
        skipped = row(
            "kernels",
            "grouped_mm",
            "-",
            None,
            None,
            "",
            "skipped: megatronish_kernels has no grouped GEMM kernel",
        )
        jobs.append(Job("kernels", "grouped_mm", lambda _t: ([skipped], {})))
    jobs.append(Job("compile", "every kernel for this GPU's arch", compile_job))
    configs = list(TRAIN_CONFIGS[:1] if quick else TRAIN_CONFIGS)
    steps, warmup = (3, 1) if quick else (5, 2)
    jobs += training_jobs(configs, gpu_count, steps, warmup)
    timer = cuda_gemm_timer(measure)
    jobs.append(Job("calibration", "device file", calibration_job(timer, device_file)))
    jobs.append(Job("tp-overlap", "split GEMM", split_gemm_job("cuda", measure)))
    if gpu_count >= 2:
        jobs.append(Job("tp-overlap", "tp2 bench", overlap_bench_job(steps, warmup), TRAIN_RUN_S))
    return jobs + fp8_jobs(quick, measure)


def fp8_jobs(quick: bool, measure: Callable) -> list[Job]:
    """The fp8 phase (scripts/gpu_fp8.py): the GEMMs, then the training runs (--quick: bf16
    and blockwise only); a skipped row on a GPU without fp8 (compute capability below 8.9)."""
    import torch

    fp8 = load_script("gpu_fp8")
    if torch.cuda.get_device_capability() < (8, 9):
        skipped = row("fp8", "fp8", "-", None, None, "", "skipped: no fp8 below sm_89")
        return [Job("fp8", "fp8", lambda _t: ([skipped], {}))]
    recipes = ("blockwise",) if quick else fp8.RECIPES
    return [
        Job("fp8", "GEMMs", fp8.fp8_gemm_job("cuda", measure)),
        Job("fp8", "training", fp8.fp8_training_job(run_command, recipes)),
    ]


def failed(rows: list[Row]) -> bool:
    """Whether a figure is out of bounds or a check did not run to the end."""
    return any(r["status"].startswith(("FAIL", "failed")) for r in rows)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0 all ok or skipped, 1 a row failed, 2 no
    GPU or an unreadable --from-json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_check.json", help="where the results go")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, gpt2-124m only")
    parser.add_argument("--from-json", metavar="PATH", help="print a recorded table, run nothing")
    parser.add_argument(
        "--device-file", default=str(DEVICE_FILE), help="where the calibrated device file goes"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        try:
            print(render(json.loads(Path(args.from_json).read_text())))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"gpu_check: {args.from_json}: not a gpu_check record ({exc})", file=sys.stderr)
            return 2
        return 0
    import torch  # the check first: the kernels and Triton are imported after it

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    clock = Clock()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results: dict[str, Any] = {"started": started, "quick": args.quick, "budget_s": BUDGET_S}
    results.update(environment())
    jobs = plan_jobs(args.quick, len(results["gpus"]), Path(args.device_file))
    rows, details = run_jobs(jobs, clock, progress=lambda line: print(line, file=sys.stderr))
    results.update(rows=rows, details=details, wall_s=clock.elapsed())
    print(render(results))
    try:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    except OSError as exc:
        print(f"gpu_check: could not write {args.json}: {exc}", file=sys.stderr)
        return 1
    print(f"\nresults: {args.json}")
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
