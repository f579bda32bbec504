"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

``run_on_ranks(fn, world_size, *args)`` starts world_size processes, initializes a gloo process
group on a free port in each, calls ``fn(rank, world_size, *args)`` and returns the list of
results in rank order. A worker's exception is re-raised here with its traceback; a worker that
does not finish within ``timeout`` seconds, or dies, fails the test instead of hanging it.

``run_cli_on_ranks(args, world_size)`` runs ``megatronish ARGS`` on world_size such processes
as torchrun starts a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; the command joins the process group itself) and returns each rank's
CompletedProcess: its exit status and what it wrote to stdout and stderr.

The processes are forked from a server that imported torch and megatronish once per session
(multiprocessing's "forkserver"), so each is as fresh as a spawned one (nothing a test leaves
behind reaches the next: process groups, RNG state, shared memory, module state) without paying
for those imports again. Each sees the environment of the caller at the time of the call.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import queue as queue_module
import random
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server; a module that fails to import is left to each worker.
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatronish.training.trainer",
    "megatronish.commands.bench",
    "megatronish.checkpoint.load",
    "megatronish.checkpoint.save",
    "megatronish.inference.generate",
    "megatronish.commands.launch",  # torchrun's modules, for a forked launcher (tests/forked.py)
    "numpy.random",  # imported by numpy at a loader's first permutation
    "numpy.ma",  # and at its first np.unique
    "numpy.ctypeslib",  # and by safetensors at a rank's first save
    "tests.ranks",
    "tests.conftest",  # what test modules import (pytest, click's runner, the CLI)
    "tests.parity",  # the training tests' harness
]
_context = mp.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _measure_the_cpu_peak() -> None:
    """The CPU's fp32 matmul rate that a trainer divides by for MFU (training.metrics
    .peak_flops), measured once per process and thread count, measured here at a rank's one
    thread: run by the fork server as it imports this module, so that no forked rank measures
    it again (a fifth of a second of matmuls each, more on a busy host)."""
    from megatronish.training.metrics import peak_flops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak_flops(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


_measure_the_cpu_peak()


def _port_window() -> range:
    """This test process's own ports: a slice, one per pytest-xdist worker, of the ports below
    the kernel's ephemeral range (or above it). A port the kernel hands out (bind to port 0, or
    the local end of each gloo connection) is in the ephemeral range, so a port found free
    there can be taken by another worker's connection before a store listens on it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            low, high = map(int, file.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    start, stop = (max(1024, low - 12000), low) if low >= 8192 else (high + 1, 65536)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    slices = 8
    size = (stop - start) // slices
    first = start + (int(worker) % slices if worker.isdigit() else 0) * size
    return range(first, first + size)


_PORTS = _port_window()  # empty where the ephemeral range leaves no room
# where this process starts in its window (another session on the host starts elsewhere)
_next_port = itertools.count(random.randrange(max(1, len(_PORTS))))


def free_port() -> int:
    """A port of this process's window that nothing holds now (see _port_window); the kernel's
    choice where the window is all taken."""
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_next_port) % len(_PORTS)]
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, timeout, environ, join=True):
    """Calls fn(rank, world_size, *args) in the caller's environment, in the gloo group of the
    ranks when join (else fn joins it, from the environment), and sends its result."""
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if join:
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


def _next_result(queue, procs, deadline: float, timeout: float):
    """The next (rank, ok, value) a worker sent; an error once the deadline passes or a worker
    exits without sending one."""
    while True:
        with contextlib.suppress(queue_module.Empty):
            return queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            raise TimeoutError(f"a rank did not finish within {timeout} s")
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            try:  # it may have sent its result just before it exited
                return queue.get(timeout=1.0)
            except queue_module.Empty:
                rank, code = dead[0]
                raise RuntimeError(f"rank {rank} exited with status {code}") from None


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Results of fn(rank, world_size, *args) on each of world_size gloo ranks, in rank order."""
    return _run(fn, world_size, args, timeout, dict(os.environ), join=True)


def run_cli_on_ranks(
    args: list[str], world_size: int, timeout: float = 120.0, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """`megatronish ARGS` on world_size ranks as torchrun starts them, with env added to the
    caller's environment: each rank's exit status, stdout and stderr, in rank order. A rank
    that outlives timeout fails the call. What the fork server wrote while importing (an
    import-time warning) is no rank's: a launched subprocess is the test of that."""
    environ = dict(os.environ, **(env or {}))
    environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    return _run(_cli_rank, world_size, (list(args),), timeout, environ, join=False)


def _cli_rank(rank: int, world_size: int, args: list[str]) -> subprocess.CompletedProcess:
    """`megatronish ARGS` in this rank, its stdout and stderr (the file descriptors, so what
    torch and gloo write there too) captured."""
    from megatronish.cli import cli

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            cli.main(args=args, prog_name="megatronish")
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - as Python reports an uncaught exception
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        outputs = []
        for file in (out, err):
            file.seek(0)
            outputs.append(file.read().decode(errors="replace"))
    return subprocess.CompletedProcess(["megatronish", *args], status, *outputs)


def _run(fn: Callable, world_size: int, args: tuple, timeout: float, environ: dict, join: bool):
    """fn(rank, world_size, *args) on world_size forked ranks with environ (see _worker); the
    results in rank order, or the first failure."""
    queue = _context.Queue()
    port = free_port()
    procs = [
        _context.Process(
            target=_worker, args=(r, world_size, port, fn, args, queue, timeout, environ, join)
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = _next_result(queue, procs, deadline, timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:  # after a failure the other ranks may wait forever: stop them
            proc.join(timeout=10 if len(results) == world_size else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]
