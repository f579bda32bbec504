"""What a run does when something goes wrong around it or inside it.

- Its launcher dies (kill -9 of torchrun or `megatronish launch`): every rank asked the kernel
  for SIGKILL when its parent dies (`die_with_parent`), so no rank trains on as an orphan.
  SIGKILL leaves nothing half-done: a checkpoint is written under a temporary name and renamed,
  `latest` is replaced last, and a resumed run drops a partial metrics line.
- A second run starts on the same checkpoint.dir: rank 0 holds an exclusive lock on
  <checkpoint.dir>/lock for the whole run (`run_lock`); the second run exits with status 2 and
  one line naming the directory and the holder. The kernel drops the lock of a process that
  dies, so the lock file a killed run leaves behind is simply taken over.
- The run is asked to stop (SIGTERM, or SIGUSR1 as Slurm sends before a time limit) on any rank
  or on its launcher: `StopSignals` turns the signal into a request, and the ranks agree on it
  at the end of the step (`agree_on_step`), save a checkpoint and exit with status 0.
- A step's loss or gradient norm is not finite on some rank: `agree_on_step` makes every rank
  skip that optimizer update alike.
- Another rank fails: the collective this rank waits in fails (gloo sees the connection close,
  the shared-memory path sees the process gone, or parallel.timeout_s passes); `lost_peer`
  recognises that, and the rank exits with status 1 and no traceback of its own (rank 0 says
  in one line that another rank failed; the rank that failed has printed why).

Importing this module is cheap (no torch): the CLI calls `die_with_parent` first thing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatronish.errors import PeerLost, UserError

if TYPE_CHECKING:
    import torch

    from megatronish.parallel import ParallelState

LOCK_FILE = "lock"
PROC = Path("/proc")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What gloo says when the other end of a collective has gone away or stopped answering.
GLOO_PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
)


# --------------------------------------------------------------------------------------------
# Dying with the launcher


def die_with_parent(poll_s: float = 1.0, use_prctl: bool = True) -> None:
    """Makes this process get SIGKILL when its parent exits: Linux's prctl(PR_SET_PDEATHSIG),
    elsewhere (or with use_prctl=False) a daemon thread that checks the parent pid every poll_s
    seconds. A parent that is already gone by the time the request is in place kills it at once."""
    parent = os.getppid()
    if not (use_prctl and _request_parent_death_signal()):
        threading.Thread(
            target=_watch_parent, args=(parent, poll_s), name="parent-watch", daemon=True
        ).start()
    if os.getppid() != parent:
        _kill_self()


def under_launcher() -> bool:
    """Whether torchrun (torch.distributed.run, which `megatronish launch` runs) started us."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _request_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _watch_parent(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _kill_self()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def child_pids(pid: int | None = None) -> list[int]:
    """The live (not zombie) child processes of pid (default: this process), from /proc on
    Linux, from `pgrep -P` elsewhere."""
    pid = os.getpid() if pid is None else pid
    if not PROC.is_dir():
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return [int(p) for p in found.stdout.split()]
    children = []
    for entry in PROC.iterdir():
        stat = _proc_stat(entry.name) if entry.name.isdigit() else None
        if stat is not None and stat[1] == pid and stat[0] != "Z":
            children.append(int(entry.name))
    return sorted(children)


def process_alive(pid: int) -> bool:
    """Whether process pid exists and has not exited (a zombie, exited but not yet reaped by its
    parent, counts as exited where /proc tells)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_stat(str(pid)) if PROC.is_dir() else None
    return stat is None or stat[0] != "Z"


def _proc_stat(pid: str) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc/<pid>/stat; None if it is gone."""
    try:
        fields = (PROC / pid / "stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# One writer per checkpoint directory


class RunLock:
    """An exclusive flock on <directory>/lock, whose content names the holder (pid and host).
    The kernel releases it when the holder exits, however it exits, so there is no stale lock:
    the file a killed run leaves is taken over by the next run."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises a UserError naming the directory and the holder."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(
                f"checkpoint.dir {self.directory}: cannot create {LOCK_FILE} there "
                f"({exc.strerror}); set checkpoint.dir to a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"checkpoint.dir {self.directory}: another run is writing there ({holder}); "
                "wait for it to finish, stop it, or set checkpoint.dir to another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def ensure_unlocked(directory: str | os.PathLike[str]) -> None:
    """Raises the UserError RunLock.acquire would, without keeping the lock (so `launch` can
    refuse a locked directory in one line before it starts any rank)."""
    lock = RunLock(directory)
    lock.acquire()
    lock.release()


@contextlib.contextmanager
def run_lock(directory: str | os.PathLike[str], ps: ParallelState) -> Iterator[None]:
    """Holds RunLock(directory) on global rank 0 for the body. Every rank enters (one
    all-reduce): when rank 0 cannot take the lock, every rank raises the UserError, which only
    rank 0 prints."""
    lock = RunLock(directory)
    error: UserError | None = None
    if ps.is_main:
        try:
            lock.acquire()
        except UserError as exc:
            error = exc
    if any_rank(error is not None, ps.device):
        if error is None:
            error = UserError(f"checkpoint.dir {lock.directory}: locked (rank 0 says by whom)")
        error.rank0_prints = True
        raise error
    try:
        yield
    finally:
        lock.release()


# --------------------------------------------------------------------------------------------
# Stop requests and the agreement at the end of each step


class StopSignals:
    """Between install() and restore(), SIGTERM and SIGUSR1 no longer end the process: they ask
    the run to stop at the end of the current step (`requested` names the first signal; None:
    not asked). restore() puts the previous handlers back."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@contextlib.contextmanager
def forward_stop_signals() -> Iterator[None]:
    """While entered (in a launcher), SIGTERM and SIGUSR1 are passed on to this process's
    children, the ranks, which save at the end of their step and exit 0; the launcher then
    finishes as after any successful run. With no rank running (before they start, between
    restarts) the signal ends the launcher with status 128 + signal, as it would have."""

    def forward(signum: int, frame) -> None:
        children = child_pids()
        if not children:
            raise SystemExit(128 + signum)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class StepVerdict:
    """What every rank does after a step, the same on all of them. `nonfinite` names what was
    not finite on some rank ("loss", "grad_norm"); empty means the update is applied. `stop`:
    some rank was asked to stop, so the run saves after this step and exits."""

    nonfinite: tuple[str, ...] = ()
    stop: bool = False

    @property
    def skip(self) -> bool:
        """No optimizer update for this step."""
        return bool(self.nonfinite)


def agree_on_step(
    loss: float | None, grad_norm: float, stop_requested: bool, ps: ParallelState
) -> StepVerdict:
    """The StepVerdict of a step from this rank's view: its loss (None where this rank has no
    loss), the gradient norm and whether it was asked to stop. Three fp32 flags, reduced (MAX)
    over the tp group, the dp x cp group and then the pp group, so over every rank: a rank
    that alone sees a NaN or a signal decides for all. (Two tiny all-reduces rather than one
    over the world: these groups take the shared-memory path on one host, the world does not.)"""
    import torch
    import torch.distributed as dist

    from megatronish import comm

    local = [
        loss is not None and not math.isfinite(loss),
        not math.isfinite(grad_norm),
        stop_requested,
    ]
    flags = torch.tensor(local, dtype=torch.float32, device=ps.device)
    comm.all_reduce(flags, ps.tp_group, op=dist.ReduceOp.MAX)
    comm.all_reduce(flags, ps.dp_cp_group, op=dist.ReduceOp.MAX)
    if ps.pp > 1:
        comm.all_reduce(flags, ps.pp_group, op=dist.ReduceOp.MAX)
    loss_bad, norm_bad, stop = (bool(x) for x in flags.tolist())
    nonfinite = tuple(name for name, bad in (("loss", loss_bad), ("grad_norm", norm_bad)) if bad)
    return StepVerdict(nonfinite, stop)


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether flag is set on any rank of the world (one all-reduce; every rank calls it)."""
    import torch
    import torch.distributed as dist

    from megatronish import comm

    value = torch.tensor([1.0 if flag else 0.0], device=device)
    comm.all_reduce(value, None, op=dist.ReduceOp.MAX)
    return bool(value.item())


# --------------------------------------------------------------------------------------------
# Another rank failed


def lost_peer(exc: BaseException) -> str | None:
    """A short reason when exc says a collective failed because another rank went away (it
    exited, or did not come within parallel.timeout_s); None for any other error."""
    if isinstance(exc, (PeerLost, TimeoutError)):
        return str(exc)
    message = str(exc)
    if isinstance(exc, RuntimeError) and any(p in message for p in GLOO_PEER_ERRORS):
        first = message.strip().splitlines()[0]
        return first.split("] ", 1)[-1].split(". ", 1)[0]  # without gloo's source location
    return None
