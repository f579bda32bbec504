"""The built-in corpus, prepared once per interpreter into a cache directory and reused.

Cache root: $MEGATRONISH_CACHE, else ~/.cache/megatronish. The dataset directory is named by
the Python version and a hash of the standard library's file list (paths and sizes), so another
interpreter or an upgraded one gets its own. Several processes (the ranks of one run) may call
builtin_dataset_dir() at once: each prepares into its own staging directory and renames it into
place; a rename that loses the race is discarded and the winner's dataset is used. The process
that prepares it says so in one line on stdout (global rank 0 only, under torchrun).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from megatronish.data.corpus import Corpus, Source, builtin_files
from megatronish.data.dataset import FORMAT_VERSION, read_metadata
from megatronish.data.prepare import TokenizerChoice, write_dataset
from megatronish.errors import UserError

CACHE_ENV = "MEGATRONISH_CACHE"
BUILTIN_VAL_FRACTION = 0.01
BUILTIN_SEED = 1234


def cache_root() -> Path:
    """$MEGATRONISH_CACHE if set, else ~/.cache/megatronish."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "megatronish"


def builtin_dataset_dir() -> Path:
    """The built-in corpus (byte tokenizer) as a dataset directory, prepared on first use."""
    root, files = builtin_files()
    key = hashlib.sha256(f"format {FORMAT_VERSION} byte val {BUILTIN_VAL_FRACTION}\n".encode())
    sizes = [path.stat().st_size for path in files]
    for path, size in zip(files, sizes, strict=True):
        key.update(f"{path.relative_to(root).as_posix()} {size}\n".encode())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = cache_root() / f"stdlib-py{version}-{key.hexdigest()[:16]}"
    if target.is_dir():
        try:
            read_metadata(target)
            return target
        except UserError:
            _discard(target)  # damaged (a disk error, a hand edit): prepare it again
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as exc:
        raise UserError(
            f"{target.parent}: cannot create the dataset cache ({exc.strerror}); "
            f"set {CACHE_ENV} to a writable directory"
        ) from None
    if os.environ.get("RANK", "0") == "0":
        print(
            f"preparing the built-in corpus (the Python standard library's sources: "
            f"{len(files):,} files, {sum(sizes) / 1e6:.1f} MB) into {target} ...",
            flush=True,
        )
    corpus = Corpus([Source(p, explicit=False) for p in files], [str(root)], is_builtin=True)
    try:
        write_dataset(corpus, staging, TokenizerChoice("byte"), BUILTIN_VAL_FRACTION, BUILTIN_SEED)
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():  # not a lost race: a real failure
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    read_metadata(target)
    return target


def resolve_dataset(path: str | os.PathLike[str] | None) -> Path:
    """data.path -> a validated dataset directory (every token checked against the vocabulary);
    None -> the built-in corpus."""
    if path is None:
        directory = builtin_dataset_dir()
    else:
        directory = Path(path).expanduser()
    read_metadata(directory, validate=True)
    return directory


def _discard(target: Path) -> None:
    """Moves a damaged cache entry aside (atomic, so only one process does it) and deletes it."""
    trash = target.with_name(f".{target.name}.trash-{os.getpid()}")
    try:
        os.rename(target, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
