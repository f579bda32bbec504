"""One writer per checkpoint directory: rank 0 holds an exclusive lock on <checkpoint.dir>/lock
for the whole run (`run_lock`); a second run on the same directory exits with status 2 and one
line naming the directory and the holder. The kernel drops the lock of a process that dies, so
the lock file a killed run leaves behind is simply taken over."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from megatronish.distributed.comm import any_rank
from megatronish.errors import UserError

if TYPE_CHECKING:
    from megatronish.distributed.layout import ParallelState

LOCK_FILE = "lock"


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
    refuse a locked directory in one line before it starts any rank). Creates nothing: where
    there is no lock file, nobody holds one."""
    if not (Path(directory) / LOCK_FILE).exists():
        return
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
