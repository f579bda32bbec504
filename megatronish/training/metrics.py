"""The device peak that MFU divides by (a known GPU's data sheet, else a measured matmul rate),
the metrics.jsonl writer and the run's last line. Model FLOPs are megatronish.accounting.flops's."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatronish.accounting.hardware import GPU_PEAK_TFLOPS

if TYPE_CHECKING:
    from megatronish.config import Config


def peak_flops(device: torch.device) -> tuple[float, str]:
    """FLOP/s that MFU divides by for one device, with where the figure comes from: the dense
    bf16 peak of a known GPU, else a measured fp32 matmul rate (CPU, or an unknown GPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name} dense bf16 peak"
    return _measured(device, torch.get_num_threads()), f"measured fp32 matmul on {device.type}"


@functools.cache
def _measured(device: torch.device, threads: int) -> float:
    """measured_matmul_flops once per process, device and thread count."""
    return measured_matmul_flops(device)


def measured_matmul_flops(
    device: torch.device, size: int | None = None, trials: int = 10, min_seconds: float = 0.1
) -> float:
    """The best of at least `trials` timings of a size x size fp32 matmul, spread over at least
    `min_seconds`, after three warm-up calls: the best, because a core taken by something else
    only ever makes a trial slower, and spread so that a burst of such load on a shared host
    does not cover them all. Default size: 512 on a CPU (its rate there is 1024's, measured in
    a tenth of the time: every rank of every run measures), 1024 on a GPU."""
    if size is None:
        size = 512 if device.type == "cpu" else 1024
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    for _ in range(3):
        a @ b
    best, tried, began = float("inf"), 0, time.perf_counter()
    while tried < trials or time.perf_counter() - began < min_seconds:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best, tried = min(best, time.perf_counter() - start), tried + 1
    return 2 * size**3 / best


def mfu_text(mfu: float, peak_source: str, digits: int = 1) -> str:
    """MFU as the run prints it: the percentage and the peak it is of, and above 100% why (a
    measured peak is the rate the matmul reached while measured, on a busy host below what
    the run's GEMMs reached later; a data sheet's peak is one the model FLOPs cannot pass)."""
    note = f"vs {peak_source}"
    if mfu > 1:
        note += "; over 100%: " + (
            "the peak was measured low (the host was busier then than during these steps)"
            if peak_source.startswith("measured")
            else "the model FLOPs counted exceed the peak (a miscount)"
        )
    return f"{100 * mfu:.{digits}f}% ({note})"


class MetricsWriter:
    """Appends one JSON object a line to <out_dir>/metrics.jsonl (rank 0 only), and with
    tensorboard its scalars to <out_dir>/tb."""

    def __init__(self, out_dir: Path, enabled: bool, append: bool = False, tensorboard=False):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file = self._tensorboard = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w")
            if tensorboard:
                from megatronish.observe.tensorboard import TensorBoardWriter

                self._tensorboard = TensorBoardWriter(out_dir)

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def summary_line(summary: dict, peak_source: str) -> str:
    """The line rank 0 prints as a run ends: its last metrics (`summary`, val_loss when computed)
    and what MFU was measured against."""
    line = f"step {summary['step']}: loss {summary['loss']:.4f}"
    if "val_loss" in summary:
        line += f", val_loss {summary['val_loss']:.4f}"
    return (
        line
        + f", {summary['tokens_per_s']:.0f} tokens/s, MFU {mfu_text(summary['mfu'], peak_source)}"
    )


def progress_postfix(last: dict, peak_source: str, cfg: Config) -> dict[str, str]:
    """What the progress bar shows of a metrics line: loss, tokens/s and MFU; the MoE
    losses, imbalance (and dropped share, with a capacity factor); the peak memory."""
    mfu = last["mfu"]  # over 100% it says why
    postfix = dict(
        loss=f"{last['loss']:.4f}",
        tok_s=f"{last['tokens_per_s']:.0f}",
        mfu=mfu_text(mfu, peak_source) if mfu > 1 else f"{100 * mfu:.1f}%",
    )
    if "moe_aux_loss" in last:
        postfix["aux"] = f"{last['moe_aux_loss']:.3f}"
        postfix["z"] = f"{last['moe_z_loss']:.2f}"
        postfix["imb"] = f"{last['moe_imbalance']:.2f}"
        if cfg.model.moe.capacity_factor is not None:
            postfix["drop"] = f"{100 * last['moe_dropped_frac']:.1f}%"
    if "peak_memory_gb" in last:
        postfix["mem"] = f"{last['peak_memory_gb']:.2f}GiB"
    return postfix
