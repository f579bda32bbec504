"""`plan --device cpu`: measures this host (``measure_host``) and describes it to the step-time
model as a Device and its Efficiency (``cpu_device``), so plan can predict the step time of
layouts that run here.

Measured, each at 1 thread (what a rank gets when two share two cores) and at every core:
- matmul rate: the best of several fp32 [512, 512] x [512, 512] matmuls (the same
  measurement MFU divides by on a CPU, training.metrics), and the fraction of it a linear
  layer's GEMMs reach forward and backward (an MLP at [2048, 256] -> 1024 -> 256: the weight
  gradients' transposed operands run slower);
- attention rate: causal scaled_dot_product_attention forward + backward at [8, 4, 256, 64]
  (the FLOPs of accounting.roofline.attention_flops, 3.5 x forward), as a fraction of the
  matmul rate;
- memory-bound rate: layer norm and a residual add of a [2048, 256] fp32 tensor and tanh-gelu
  of a [2048, 1024] one (a gpt2 layer's mix), forward and backward, in bytes per second as
  accounting.layer_time counts their bytes (on a CPU these ops are bound by their arithmetic
  as much as by memory: this is their rate, not the memory's bandwidth);
- op overhead: a forward and backward through autograd of an op on a 1-element tensor, per op.
And between two processes of one thread each (spawned here): the shared-memory all-reduce
megatronish's CPU collectives use (distributed.shm), small (latency) and 4 MB (bandwidth),
and gloo's point-to-point send / receive (what pipeline sends use), small and 4 MB.

The calibration is a JSON object (saved with --calibration FILE and read back from it, so a
script measures once and tests use a fixed one).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megatronish.accounting.hardware import Device
from megatronish.accounting.roofline import Efficiency
from megatronish.errors import UserError

LARGE = 1 << 20  # fp32 elements of the bandwidth measurements' messages (4 MB)
FIELDS = ("matmul_flops", "gemm_fraction", "attention_fraction", "memory_bytes_s", "op_overhead_s")


def _best(fn, trials: int = 7) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _compute_rates(threads: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from megatronish.accounting.roofline import attention_flops
    from megatronish.training.metrics import measured_matmul_flops

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        matmul = measured_matmul_flops(torch.device("cpu"))
        q, k, v = (torch.randn(8, 4, 256, 64, requires_grad=True) for _ in range(3))

        def attention():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        flops = 3.5 * attention_flops(8, 4, 256, 256, 64, causal=True)
        x = torch.randn(2048, 256, requires_grad=True)
        up, down = torch.randn(1024, 256), torch.randn(256, 1024)
        up.requires_grad_(True)
        down.requires_grad_(True)

        def linears():  # an MLP's two GEMMs forward, and their four backward
            F.linear(F.linear(x, up), down).sum().backward()

        gemm = 3 * 2 * 2 * x.numel() * 1024 / _best(linears)
        norm = torch.nn.LayerNorm(256)
        wide = torch.randn(2048, 1024, requires_grad=True)

        def elementwise():
            (norm(x) + x).sum().backward()
            F.gelu(wide, approximate="tanh").sum().backward()

        # As accounting.layer_time counts them: norm and gelu read + write, the residual add
        # reads 2 and writes 1, backward twice the forward's bytes, 4-byte elements.
        memory = 3 * 4 * (5 * x.numel() + 2 * wide.numel()) / _best(elementwise)
        x = torch.ones(1, requires_grad=True)

        def tiny_ops():
            y = x
            for _ in range(20):
                y = y * 1.0001
            y.sum().backward()

        return {
            "matmul_flops": matmul,
            "gemm_fraction": min(1.0, gemm / matmul),
            "attention_fraction": flops / _best(attention) / matmul,
            "memory_bytes_s": memory,
            "op_overhead_s": _best(tiny_ops) / 42,  # 20 ops forward, 20 backward, sum, backward
        }
    finally:
        torch.set_num_threads(saved)


def _collective_worker(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from megatronish.distributed import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        comm.enable_shared_memory(dist.group.WORLD, 60.0)
        small, large = torch.ones(8), torch.ones(LARGE)

        def reduce(tensor):
            return lambda: comm.all_reduce(tensor, dist.group.WORLD)

        def send(tensor):
            buffer = torch.empty_like(tensor)
            return lambda: comm.exchange([(tensor, 1 - rank)], [(buffer, 1 - rank)])

        result = {}
        for name, make in (("shm_all_reduce", reduce), ("gloo_p2p", send)):
            dist.barrier()
            result[name] = (_best(make(small), 20), _best(make(large), 5))
        if rank == 0:
            queue.put(result)
    finally:
        comm.disable_shared_memory()
        dist.destroy_process_group()


def _collectives() -> dict[str, float]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_collective_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    nbytes = 4 * LARGE
    # 2 ranks: a ring all-reduce is 2 steps and sends the payload once; a send is 1 step.
    (ar_small, ar_large), (p2p_small, p2p_large) = result["shm_all_reduce"], result["gloo_p2p"]
    return {
        "shm_latency_s": ar_small / 2,
        "shm_bytes_s": nbytes / max(ar_large - ar_small, 1e-9),
        "gloo_latency_s": p2p_small,
        "gloo_bytes_s": nbytes / max(p2p_large - p2p_small, 1e-9),
    }


def measure_host() -> dict:
    """Every figure of the module doc, by thread count ("1" and all cores)."""
    cores = os.cpu_count() or 1
    by_threads = {}
    for n in sorted({1, cores}):
        # The best of five: another process taking a core only ever makes a trial slower.
        trials = [_compute_rates(n) for _ in range(5)]
        by_threads[str(n)] = {
            key: (min if key == "op_overhead_s" else max)(t[key] for t in trials) for key in FIELDS
        }
    return {"cores": cores, "threads": by_threads, **_collectives()}


def load_or_measure(path: str | None) -> dict:
    """The calibration in `path` when it exists, else a fresh measurement (saved to `path`
    when one is given)."""
    if path and Path(path).is_file():
        try:
            data = json.loads(Path(path).read_text())
            _check(data, path)
            return data
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(
                f"--calibration {path}: not a calibration this command wrote; "
                "delete it to measure again"
            ) from None
    data = measure_host()
    if path:
        Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


def _check(data: dict, path: str) -> None:
    for key in ("cores", "shm_latency_s", "shm_bytes_s", "gloo_latency_s", "gloo_bytes_s"):
        float(data[key])
    for rates in data["threads"].values():
        for key in FIELDS:
            float(rates[key])


def cpu_device(calibration: dict, world: int, intra_host_ranks: int) -> tuple[Device, Efficiency]:
    """This host as a Device for a run of `world` ranks (each with cores / world threads, at
    least one), and its Efficiency: the measured rates are what is achieved (the memory and
    link fractions 1, no tile quantization), with the measured GEMM and attention fractions,
    op overhead and latencies. Groups of the first
    `intra_host_ranks` ranks (tp x cp x dp: their collectives go through shared memory) use
    the shared-memory figures, the pipeline's sends gloo's."""
    cores = int(calibration["cores"])
    threads = max(1, cores // max(1, world))
    table = calibration["threads"]
    rates = table.get(str(threads)) or table[min(table, key=lambda k: abs(int(k) - threads))]
    device = Device(
        name=f"cpu ({threads} thread{'s' if threads > 1 else ''} a rank, measured)",
        peak_tflops=rates["matmul_flops"] / 1e12,
        memory_gb=64.0,
        hbm_tb_s=rates["memory_bytes_s"] / 1e12,
        nvlink_gb_s=calibration["shm_bytes_s"] / 1e9,
        network_gb_s=calibration["gloo_bytes_s"] / 1e9,
        gpus_per_node=max(1, intra_host_ranks),
    )
    eff = Efficiency(
        gemm_fraction=rates["gemm_fraction"],
        tile=1,
        attention_fraction=rates["attention_fraction"],
        memory_fraction=1.0,
        kernel_overhead_s=rates["op_overhead_s"],
        nvlink_fraction=1.0,
        network_fraction=1.0,
        nvlink_latency_s=calibration["shm_latency_s"],
        network_latency_s=calibration["gloo_latency_s"],
    )
    return device, eff
