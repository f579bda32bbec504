"""Writing files: atomically (a reader sees the old file or the new one, never a part), and
with modes as readable as any file the user makes.

Plain `open()` and `mkdir()` take their mode from the user's umask (0644 and 0755 under the
usual 022). Some writers create a private file or directory instead (safetensors writes 0600
through a temporary file; tempfile.mkstemp and mkdtemp give 0600 and 0700), which would keep an
exported model, a checkpoint, a hang report or a dataset from the people it is meant for:
``follow_umask`` gives such a path the mode `open()` or `mkdir()` would have.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """This process's umask, read without changing it where /proc says it (Linux); elsewhere
    set and restored at once, under a lock."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        current = os.umask(0o022)
        os.umask(current)
    return current


def follow_umask(path: str | Path) -> None:
    """Gives path the mode the umask gives a new file (0o666 & ~umask) or directory (0o777 &
    ~umask)."""
    base = 0o777 if stat.S_ISDIR(os.stat(path).st_mode) else 0o666
    os.chmod(path, base & ~umask())


def fsync_path(path: Path) -> None:
    """Flushes a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Writes text under a temporary name, fsyncs it, then os.replace()s it into place: a reader
    sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
