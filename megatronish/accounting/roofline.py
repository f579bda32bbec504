"""The time of one kernel on one device from its FLOPs and bytes (a roofline), and the few
efficiency constants the step-time model (accounting.step_time) shares across every GPU.

    time = max(FLOPs / (peak x efficiency), bytes / (memory bandwidth x MEMORY_FRACTION))
           + KERNEL_OVERHEAD_S

GEMM efficiency depends on the shape, per GPU generation (``gemm_efficiency``): the device's
gemm_fraction of the dense peak for a large GEMM (accounting.hardware gives each GPU's and its
source), times the share of the work its output tiles do in whole waves: a GEMM's output is cut
into tiles (the device's tile shape: 128 x 128 on Ampere, 128 x 256 from Hopper on, either way
round, cuBLAS picking the one that wastes least), and the tiles run in waves of one per
streaming multiprocessor, so m n / (ceil(tiles / SMs) SMs tile_m tile_n) is what the tile and
wave quantization leave (NVIDIA, "Matrix Multiplication Background User's Guide": tile and
wave quantization); a dimension smaller than the tile gets a tile just covering it (a power
of two, 16 at least), and a GEMM of fewer tiles than SMs is split along k to fill them. A
small GEMM is further slowed by its fixed KERNEL_OVERHEAD_S and, when its
arithmetic intensity is low (a few rows through a large weight), by the memory bound: it is
then memory-bound (``gemm_time`` says so). Efficiency can override the fraction and the tile
(a CPU: its measured fraction, no tiles).

An fp8 GEMM (train.precision fp8) runs at the device's dense fp8 peak with the same fraction
and tiles, reading 1-byte operands and writing a 2-byte output.

Where the other constants come from (one set for every GPU and every validation row; none is
fitted to a row):
- attention: fused (flash-style) attention at the device's attention_forward and
  attention_backward shares of the peak (accounting.hardware: 50% on Ampere, where
  FlashAttention-2 reaches 50-70% forward and 35-50% backward, Dao 2023, figures 5-6; on Hopper
  megatronish's Triton kernel, the Triton tutorial's design, 45% forward and 20% backward);
  its backward does 2.5 x the forward's FLOPs (five matmuls to two), and causal masking halves
  both.
- MEMORY_FRACTION 0.80: elementwise kernels, norms and the optimizer stream at 80-90% of the
  HBM bandwidth (the STREAM-like figures NVIDIA publishes for A100/H100; Apex/Megatron fused
  layer norm and Adam reach similar).
- KERNEL_OVERHEAD_S 4 us: a kernel's launch and tail on a busy stream (CUDA launch latency
  3-5 us).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from megatronish.accounting.hardware import Device


@dataclass(frozen=True)
class Efficiency:
    """The achievable fractions and fixed costs the time model applies to a Device's figures."""

    gemm_fraction: float | None = None
    """Of the dense peak, a large GEMM's share (None: the Device's gemm_fraction)."""
    tile: int | None = None
    """The output tile's side (None: the Device's tile shape; 1: no tile or wave
    quantization, as on a CPU)."""
    attention_fraction: float | None = None
    """Of the dense peak, fused attention's share, forward and backward alike (None: the
    Device's attention_forward and attention_backward)."""
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


def gemm_efficiency(m: int, n: int, device: Device, eff: Efficiency, batch: int = 1) -> float:
    """Of the dense peak, what an [m, *] x [*, n] GEMM (`batch` of them in one kernel, whose
    tiles share the waves) reaches on `device`: the large-GEMM fraction times the share of
    whole waves of whole tiles its output fills (module doc)."""
    fraction = device.gemm_fraction if eff.gemm_fraction is None else eff.gemm_fraction
    if eff.tile == 1:
        return fraction
    tm, tn = device.tile_shape if eff.tile is None else (eff.tile, eff.tile)
    filled = 0.0
    for rows, cols in {(tm, tn), (tn, tm)}:
        rows, cols = min(rows, _cover(m)), min(cols, _cover(n))
        tiles = batch * ceil(m / rows) * ceil(n / cols)
        slots = ceil(tiles / device.sms) * device.sms if tiles > device.sms else tiles
        filled = max(filled, batch * m * n / (slots * rows * cols))
    return fraction * filled


def _cover(size: int) -> int:
    """The smallest tile side (a power of two, 16 at least) that covers `size` rows."""
    return max(16, 1 << (size - 1).bit_length())


def gemm_time(
    m: int,
    n: int,
    k: int,
    device: Device,
    width: int,
    eff: Efficiency,
    fp8: bool = False,
    batch: int = 1,
) -> tuple[float, bool]:
    """(seconds, memory-bound) of `batch` [m, k] x [k, n] matmuls of `width`-byte elements in
    one kernel (reads both inputs, writes the output once; under fp8 1-byte inputs at the fp8
    peak, a `width` output)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0, False
    peak = device.fp8_tflops * 1e12 if fp8 else device.peak_flops
    compute = 2.0 * batch * m * n * k / (peak * gemm_efficiency(m, n, device, eff, batch))
    operand = 1 if fp8 else width
    nbytes = batch * ((m * k + k * n) * operand + m * n * width)
    memory = nbytes / (device.hbm_tb_s * 1e12 * eff.memory_fraction)
    return max(compute, memory) + eff.kernel_overhead_s, memory > compute


def attention_flops(
    batch: int,
    heads: int,
    s_q: int,
    s_k: int,
    head_dim: int,
    causal: bool,
    window: int | None = None,
    v_head_dim: int | None = None,
) -> float:
    """Forward FLOPs of softmax(q k^T) v for `heads` heads: 2 batch heads s_q s_k (head_dim +
    v_head_dim) (q k^T over the query-key head dim, p v over the value head dim; v_head_dim
    None: head_dim, 4 batch heads s_q s_k head_dim), half when causal (the masked half of the
    scores is skipped); under a causal sliding window W below s_k only the pairs it keeps, sum
    over positions of min(i + 1, W) instead of s_k (s_k + 1) / 2 (queries s_q of a sequence of
    s_k: a cp rank's share, on average)."""
    dims = head_dim + (head_dim if v_head_dim is None else v_head_dim)
    flops = 2.0 * batch * heads * s_q * s_k * dims
    if not causal:
        return flops
    if window is None or window >= s_k:
        return flops / 2
    kept = window * (window + 1) // 2 + (s_k - window) * window  # sum of min(i + 1, W)
    return flops / 2 * kept / (s_k * (s_k + 1) // 2)


def flash_attention_seconds(
    flops_forward: float, device: Device, eff: Efficiency, backward: bool
) -> float:
    """Seconds of a fused attention kernel doing flops_forward of forward work; backward does
    2.5 x as much (it recomputes the scores: five matmuls to the forward's two)."""
    flops = flops_forward * (2.5 if backward else 1.0)
    fraction = eff.attention_fraction
    if fraction is None:
        fraction = device.attention_backward if backward else device.attention_forward
    return flops / (device.peak_flops * fraction) + eff.kernel_overhead_s


def delta_rule_seconds(
    flops_forward: float, bytes_forward: float, device: Device, eff: Efficiency, backward: bool
) -> float:
    """Seconds of the chunked gated-delta-rule kernel (Gated DeltaNet) doing flops_forward and
    moving bytes_forward forward, on the roofline: the slower of its FLOPs at fused attention's
    share of the peak and its bytes at the memory share of HBM; backward does 2.5 x the FLOPs
    (it recomputes the chunk terms) and moves twice the bytes."""
    flops = flops_forward * (2.5 if backward else 1.0)
    fraction = eff.attention_fraction
    if fraction is None:
        fraction = device.attention_backward if backward else device.attention_forward
    nbytes = bytes_forward * (2 if backward else 1)
    bandwidth = device.hbm_tb_s * 1e12 * eff.memory_fraction
    return max(flops / (device.peak_flops * fraction), nbytes / bandwidth) + eff.kernel_overhead_s


def memory_seconds(nbytes: float, bandwidth: float, eff: Efficiency, kernels: int = 1) -> float:
    """Seconds of memory-bound kernels moving `nbytes` in all."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (bandwidth * eff.memory_fraction) + kernels * eff.kernel_overhead_s
