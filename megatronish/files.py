"""Writing files: atomically (a reader sees the old file or the new one, never a part), with
modes as readable as any file the user makes, and a write the system refuses (a full disk or
quota, the file-size limit, a directory that is not writable) reported in one line, with
nothing of a command's half-written output left behind.

Plain `open()` and `mkdir()` take their mode from the user's umask (0644 and 0755 under the
usual 022). Some writers create a private file or directory instead (safetensors writes 0600
through a temporary file; tempfile.mkstemp and mkdtemp give 0600 and 0700), which would keep an
exported model, a checkpoint, a hang report or a dataset from the people it is meant for:
``follow_umask`` gives such a path the mode `open()` or `mkdir()` would have.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from megatronish.errors import RunFailure

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
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


# The errors that say the file did not fit: the disk, the user's quota, the file-size limit.
SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def size_text(n: float) -> str:
    """A byte count for people, in powers of 1000: 512 B, 3.1 kB, 41.2 MB."""
    units = ("B", "kB", "MB", "GB", "TB")
    power = 0
    while abs(n) >= 1000 and power < len(units) - 1:
        n, power = n / 1000, power + 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def free_space(path: Path) -> tuple[Path, int]:
    """(the filesystem's mount point, the bytes free to the user on it) for `path`, or for its
    nearest existing ancestor where it does not exist yet."""
    where = Path(path).absolute()
    while not where.is_dir() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    where = where.resolve()
    while not os.path.ismount(where):
        where = where.parent
    return where, free


def write_failure(exc: OSError, path: Path, needed: int | None = None) -> str:
    """One line naming what could not be written (the file or directory exc names, else `path`;
    both names of a rename) and why; where space is the cause (ENOSPC, EDQUOT, EFBIG) also the
    bytes `needed`, those free for it (counting what a partial file of it holds already) and a
    file-size limit that is set."""
    name = Path(exc.filename) if exc.filename is not None else Path(path)
    action = f"write {name}" if exc.filename2 is None else f"rename {name} to {exc.filename2}"
    cause = exc.strerror or str(exc)
    line = f"cannot {action}: {cause[:1].lower()}{cause[1:]}"
    if exc.errno not in SPACE_ERRORS:
        return line
    where, free = free_space(name.parent)
    with contextlib.suppress(OSError):
        free += name.stat().st_size if name.is_file() else 0
    details = [] if needed is None else [f"needed {size_text(needed)}"]
    details.append(f"{size_text(free)} free on {where}")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if exc.errno == errno.EFBIG and limit != resource.RLIM_INFINITY:
        details.append(f"the file-size limit (ulimit -f) is {size_text(limit)}")
    return f"{line} ({', '.join(details)})"


@contextlib.contextmanager
def write_failures(path: Path, needed: int | None = None) -> Iterator[None]:
    """Turns an OSError raised in the body, which writes `path` (`needed` bytes), creates it or
    renames it, into a RunFailure (exit status 1) whose message is write_failure's one line."""
    try:
        yield
    except OSError as exc:
        raise RunFailure(write_failure(exc, path, needed)) from exc


def write_file(path: Path, data: bytes) -> None:
    """Writes `data` to `path` and flushes it to disk; a write the system refuses is a
    RunFailure naming the file and the bytes needed (write_failures)."""
    with write_failures(path, len(data)), open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def nothing_left_on_failure(out: Path, staging: Path | None = None) -> Iterator[None]:
    """For a command that writes the new file or directory `out` whole or not at all (through
    `staging`, a temporary sibling renamed into place at the end): when the body raises,
    removes staging and what the body made of out's path (out and the missing directories above
    it; an `out` that existed before is kept, with what it held), then raises an OSError as
    write_failure's one line, naming the file the error names or else `out` (a RunFailure; the
    space free is counted once the partial output is gone)."""
    made: Path | None = None
    target = Path(out).absolute()
    if not (target.exists() or target.is_symlink()):
        made = target
        while not made.parent.exists():
            made = made.parent
    try:
        yield
    except BaseException as exc:
        for path in (staging, made):
            if path is not None:
                _remove(path)
        if isinstance(exc, OSError):
            raise RunFailure(write_failure(exc, out)) from exc
        raise
