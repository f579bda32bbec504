"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

``run_on_ranks(fn, world_size, *args)`` spawns world_size processes, initializes a gloo process
group on a free port in each, calls ``fn(rank, world_size, *args)`` and returns the list of
results in rank order. A worker's exception is re-raised here with its traceback; a worker that
does not finish within ``timeout`` seconds fails the test instead of hanging it.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # bytes, not shared-memory tensors, so they outlive this process
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Results of fn(rank, world_size, *args) on each of world_size gloo ranks, in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except queue_module.Empty as exc:
                raise TimeoutError(f"a rank did not finish within {timeout} s") from exc
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world_size)]
