"""This process and the others on its host: dying with the parent (a rank must not outlive its
launcher), whether a process is alive, and a process's children, from /proc on Linux.

Importing this module is cheap (no torch): the CLI calls `die_with_parent` first thing."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PROC = Path("/proc")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
