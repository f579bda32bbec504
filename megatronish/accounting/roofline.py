"""The time of one kernel on one device from its FLOPs and bytes (a roofline), and the few
efficiency constants the step-time model (accounting.step_time) shares across every GPU.

    time = max(FLOPs / (peak x efficiency), bytes / (memory bandwidth x MEMORY_FRACTION))
           + KERNEL_OVERHEAD_S

GEMM efficiency, one curve for size and tile quantization: GEMM_FRACTION of the dense peak
for a large GEMM, times the share of the output tiles (TILE x TILE) that hold real rows and
columns (m n / (ceil(m/TILE) TILE ceil(n/TILE) TILE)); a small GEMM is slowed by its fixed
KERNEL_OVERHEAD_S and, when its arithmetic intensity is low, by the memory bound.

Where the constants come from (one set for every GPU and every validation row; none is fitted
to a row):
- GEMM_FRACTION 0.80: cuBLAS reaches about 80% of the dense fp16/bf16 peak on the large GEMMs
  of transformer layers (NVIDIA, "Matrix Multiplication Background User's Guide" and
  "GPU Performance Background", A100 fp16 GEMM throughput figures; on H100 large bf16 GEMMs
  run at 700-800 of 989 TFLOP/s in NVIDIA's and others' published measurements).
- TILE 128: cuBLAS's and CUTLASS's usual output tile for large bf16 GEMMs (128 x 128 or
  128 x 256 thread-block tiles; NVIDIA's guide on tile quantization).
- ATTENTION_FRACTION 0.50: fused (flash-style) attention reaches 50-70% of the A100 peak
  forward and 35-50% backward (Dao, "FlashAttention-2", 2023, figures 5-6); its backward does
  2.5 x the forward's FLOPs (five matmuls to two), and causal masking halves both.
- MEMORY_FRACTION 0.80: elementwise kernels, norms and the optimizer stream at 80-90% of the
  HBM bandwidth (the STREAM-like figures NVIDIA publishes for A100/H100; Apex/Megatron fused
  layer norm and Adam reach similar).
- KERNEL_OVERHEAD_S 4 us: a kernel's launch and tail on a busy stream (CUDA launch latency
  3-5 us).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil


@dataclass(frozen=True)
class Efficiency:
    """The achievable fractions and fixed costs the time model applies to a Device's figures."""

    gemm_fraction: float = 0.80
    tile: int = 128
    attention_fraction: float = 0.50
    memory_fraction: float = 0.80
    kernel_overhead_s: float = 4e-6
    nvlink_fraction: float = 0.80
    """Of the NVLink bandwidth, what a ring collective's bus bandwidth reaches: nccl-tests on
    DGX A100 report ~230 of 300 GB/s all-reduce bus bandwidth, on DGX H100 ~360 of 450."""
    network_fraction: float = 0.90
    """Of the network bandwidth per GPU: nccl-tests across InfiniBand nodes reach ~90% of the
    line rate (e.g. ~23 of 25 GB/s on HDR 200 Gb/s)."""
    nvlink_latency_s: float = 5e-6
    """Per ring step inside a node (NCCL's small-message latency on NVLink, a few us a hop)."""
    network_latency_s: float = 10e-6
    """Per ring step across nodes (InfiniBand and NCCL's proxy, ~5-10 us a hop)."""


GPU_EFFICIENCY = Efficiency()


def gemm_seconds(
    m: int, n: int, k: int, peak_flops: float, bandwidth: float, width: int, eff: Efficiency
) -> float:
    """Seconds of one [m, k] x [k, n] matmul of `width`-byte elements (reads both inputs,
    writes the output once)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    tile = eff.tile
    quantization = m * n / (ceil(m / tile) * tile * ceil(n / tile) * tile)
    compute = 2.0 * m * n * k / (peak_flops * eff.gemm_fraction * quantization)
    memory = (m * k + k * n + m * n) * width / (bandwidth * eff.memory_fraction)
    return max(compute, memory) + eff.kernel_overhead_s


def attention_flops(
    batch: int,
    heads: int,
    s_q: int,
    s_k: int,
    head_dim: int,
    causal: bool,
    window: int | None = None,
) -> float:
    """Forward FLOPs of softmax(q k^T) v for `heads` heads: 4 batch heads s_q s_k head_dim,
    half when causal (the masked half of the scores is skipped); under a causal sliding window
    W below s_k only the pairs it keeps, sum over positions of min(i + 1, W) instead of
    s_k (s_k + 1) / 2 (queries s_q of a sequence of s_k: a cp rank's share, on average)."""
    flops = 4.0 * batch * heads * s_q * s_k * head_dim
    if not causal:
        return flops
    if window is None or window >= s_k:
        return flops / 2
    kept = window * (window + 1) // 2 + (s_k - window) * window  # sum of min(i + 1, W)
    return flops / 2 * kept / (s_k * (s_k + 1) // 2)


def flash_attention_seconds(
    flops_forward: float, peak_flops: float, eff: Efficiency, backward: bool
) -> float:
    """Seconds of a fused attention kernel doing flops_forward of forward work; backward does
    2.5 x as much (it recomputes the scores: five matmuls to the forward's two)."""
    flops = flops_forward * (2.5 if backward else 1.0)
    return flops / (peak_flops * eff.attention_fraction) + eff.kernel_overhead_s


def memory_seconds(nbytes: float, bandwidth: float, eff: Efficiency, kernels: int = 1) -> float:
    """Seconds of memory-bound kernels moving `nbytes` in all."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (bandwidth * eff.memory_fraction) + kernels * eff.kernel_overhead_s
