"""Calibrating the step-time model to one's own GPU: the GEMM shapes of the shipped configs
(``shipped_gemm_shapes``), the Device that measured GEMM times over them imply
(``calibrated_device``), and the device file `plan --gpu FILE` reads (``write_device_file``;
accounting.hardware.load_device reads it back). scripts/gpu_check.py measures and writes it.

Calibration keeps the datasheet's dense bf16 peak (MFU is quoted against it) and sets:
- gemm_fraction: the median over the measured shapes of the roofline's compute time at a
  fraction of 1 (its tile and wave quantization included) over the measured time, so that the
  model's times of those shapes are the measured ones in the median;
- fp8_tflops: the measured fp8 rate of the large GEMM over gemm_fraction, so that the model
  reaches the measured fp8 rate on it (0 when the GPU ran no fp8 GEMM).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path

from megatronish.accounting.hardware import Device
from megatronish.accounting.layer_time import linear_shapes
from megatronish.accounting.roofline import Efficiency, gemm_efficiency
from megatronish.config import derive, load_config, world_size_of

LARGE = (8192, 8192, 8192)  # the GEMM whose rate is the fp8 peak's measure


def shipped_gemm_shapes(configs: list[Path]) -> list[tuple[int, int, int]]:
    """(m, n, k) of the forward GEMMs of every tensor-parallel linear of each config on one rank
    of its own layout and micro-batch, each shape once, in the order met."""
    shapes: dict[tuple[int, int, int], None] = {}
    for path in configs:
        cfg = load_config(path)
        derived = derive(cfg, world_size_of(cfg), vocab_size=cfg.model.vocab_size or 50304)
        for shape in linear_shapes(cfg, derived).values():
            shapes.setdefault(shape, None)
    return list(shapes)


def calibrated_device(
    base: Device, bf16_seconds: dict[tuple[int, int, int], float], fp8_large_s: float | None
) -> Device:
    """`base` with gemm_fraction and fp8_tflops from measured times (module doc): bf16_seconds,
    the measured seconds of each bf16 (m, n, k); fp8_large_s, of the LARGE GEMM in fp8 (None:
    not measured)."""
    whole = Efficiency(gemm_fraction=1.0)
    ratios = [
        2.0 * m * n * k / (base.peak_flops * gemm_efficiency(m, n, base, whole)) / seconds
        for (m, n, k), seconds in bf16_seconds.items()
    ]
    fraction = min(1.0, statistics.median(ratios))
    fp8 = 0.0
    if fp8_large_s:
        m, n, k = LARGE
        rate = 2.0 * m * n * k / fp8_large_s
        fp8 = rate / (fraction * gemm_efficiency(m, n, base, whole)) / 1e12
    return dataclasses.replace(base, gemm_fraction=round(fraction, 4), fp8_tflops=round(fp8, 1))


def write_device_file(device: Device, path: Path) -> None:
    """Every field of `device` as the YAML mapping `--gpu FILE` reads, written whole or not at
    all (a temporary file renamed over the path)."""
    lines = [f"{f.name}: {getattr(device, f.name)}" for f in dataclasses.fields(device)]
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, path)
