"""Output paths checked before any work starts: a directory or file a command will write must
not be a file (or a directory), lie under a file, or sit where nothing can be written. Each
check raises a UserError naming the key or flag and the path, and creates nothing."""

from __future__ import annotations

import os
from pathlib import Path

from megatronish.errors import UserError


def _check_creatable(out: Path, name: str) -> None:
    """The nearest existing parent of `out` must be a writable directory, so that `out` (and the
    directories between) can be made there."""
    ancestor = next((parent for parent in out.parents if parent.exists()), Path("."))
    if not ancestor.is_dir():
        raise UserError(
            f"{name} {out}: lies under {ancestor}, which is a file; choose a path in a directory"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{name} {out}: cannot be written ({ancestor} is not writable)")


def require_output_dir(path: str | os.PathLike[str], name: str) -> Path:
    """Path `path` (given as key or flag `name`) as a directory to write into: it is one, or it
    can be made; UserError naming both otherwise. Creates nothing."""
    out = Path(path).expanduser()
    if not out.exists():
        _check_creatable(out, name)
    elif not out.is_dir():
        raise UserError(f"{name} {out}: is a file, not a directory; choose another path")
    elif not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"{name} {out}: cannot be written (the directory is not writable)")
    return out


def require_new_output_dir(path: str | os.PathLike[str], name: str) -> Path:
    """As require_output_dir, and the directory must not exist yet or be empty (a command that
    writes a whole new directory, never into another one). Creates nothing."""
    out = require_output_dir(path, name)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{name} {out}: exists and is not empty; choose a new directory")
    return out


def require_output_file(path: str | os.PathLike[str], name: str) -> Path:
    """Path `path` (given as flag `name`) as a file to write (or replace): not a directory, and
    its directory one that exists or can be made, writable; UserError naming both otherwise.
    Creates nothing."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise UserError(f"{name} {out}: is a directory; give the path of a file")
    _check_creatable(out, name)
    return out
