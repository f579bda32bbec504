"""A disk too small for what a command writes, for the tests of full disks: a tmpfs of a few
pages where this process may mount one (a write past it fails with ENOSPC, as on a full disk),
else a file-size limit on the command's own process (RLIMIT_FSIZE: a write past it fails with
EFBIG). Either is a real refusal by the kernel, met by the command's own code."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SMALL_DISK_BYTES = 64 * 1024  # 16 pages: less than any tiny model's weights
CAUSE = r"(no space left on device|file too large)"  # the tmpfs's, the file-size limit's


def file_size_limit(limit: int):
    """A preexec_fn: the child can write no file larger than `limit` bytes (SIGXFSZ ignored, so a
    write past it fails with EFBIG instead of killing the process). Picklable, for a forked
    process (tests/forked.py) too."""
    return functools.partial(_limit_file_size, limit)


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: int) -> Iterator[bool]:
    """A tmpfs of `size` bytes mounted on the empty directory `mount` for the block (unmounted
    after it); yields whether it could be mounted (False: this process may not mount one)."""
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]
    try:
        mounted = subprocess.run(command, capture_output=True).returncode == 0
    except FileNotFoundError:
        mounted = False
    try:
        yield mounted
    finally:
        if mounted and subprocess.run(["umount", str(mount)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


@dataclass(frozen=True)
class SmallDisk:
    """`root`: where a command's output goes; on a tmpfs of `size` bytes when `mounted`, else a
    plain directory whose commands run under a file-size limit of `size` bytes."""

    root: Path
    size: int
    mounted: bool

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """`megatronish ARGS`, its writes limited to the disk's size: in this process on the
        tmpfs (invoke_cli), else in a subprocess under the file-size limit."""
        from tests.conftest import REPO, invoke_cli

        if self.mounted:
            return invoke_cli(*args)
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=path)
        return subprocess.run(
            [sys.executable, "-m", "megatronish", *args], capture_output=True, text=True,
            env=env, preexec_fn=file_size_limit(self.size), timeout=180,
        )  # fmt: skip

    def leftovers(self) -> list[str]:
        """What is left on the disk (a tmpfs holds nothing else)."""
        return sorted(p.name for p in self.root.iterdir())


@contextlib.contextmanager
def small_disk(root: Path, size: int = SMALL_DISK_BYTES) -> Iterator[SmallDisk]:
    """A SmallDisk at the new directory `root`, for the block."""
    root.mkdir()
    with mounted_tmpfs(root, size) as mounted:
        yield SmallDisk(root, size, mounted)
