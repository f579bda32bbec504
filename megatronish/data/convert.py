"""`prepare` to and from Megatron indexed datasets (indexed.py), documents kept exactly.

    --input PREFIX.idx --vocab-size N --eod-id ID --output DIR      a Megatron prefix -> our
        dataset directory (tokenizer kind "none"; --val-fraction documents for validation)
    ... --output-format megatron --output PREFIX                     PREFIX.bin + PREFIX.idx from
        text (tokenized as `prepare` does), a Megatron prefix or a prepared dataset directory

Every document (a Megatron sequence; one of ours, with its end-of-text token) maps to one
document of the other format, token for token. Output goes under temporary names renamed at
the end, so a failure leaves nothing at the output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from megatronish.data.dataset import (
    FORMAT,
    FORMAT_VERSION,
    METADATA_FILE,
    TOKENS_FILE,
    token_dtype,
)
from megatronish.data.indexed import (
    bin_path,
    check_token_ids,
    idx_path,
    prefix_of,
    read_indexed,
    write_indexed,
)
from megatronish.data.prepare import prepare_dataset, write_documents
from megatronish.data.sources import TokenSource, open_prepared
from megatronish.errors import UserError
from megatronish.files import follow_umask, nothing_left_on_failure

OUTPUT_FORMATS = ("megatronish", "megatron")
_CHUNK = 1 << 22  # tokens copied at a time


def prepare_any(
    inputs: list[str],
    output: str,
    output_format: str = "megatronish",
    vocab_size: int | None = None,
    eod_id: int | None = None,
    **options: Any,
) -> Path:
    """`prepare` for every input and output format; returns the output (directory or prefix).
    options are prepare_dataset's (tokenizer, glob_pattern, jsonl_field, val_fraction, seed,
    sft). A write the system refuses (a full disk) is a RunFailure naming the output (the
    directory, or PREFIX.bin), with nothing left behind."""
    if output_format not in OUTPUT_FORMATS:
        raise UserError(f"--output-format {output_format}: must be one of megatronish, megatron")
    source = _dataset_input(inputs, vocab_size, eod_id)
    if source is None and eod_id is not None:
        raise UserError("--eod-id: applies to a Megatron prefix input (--input PREFIX.idx) only")
    flag = "--preference" if options.get("preference") else "--sft" if options.get("sft") else ""
    if flag and source is not None:
        raise UserError(f"{flag}: reads JSON Lines files; {source.path} is already a dataset")
    masked = bool(flag) or (source is not None and source.loss_mask is not None)
    if output_format == "megatron" and masked:
        raise UserError(
            "--output-format megatron: a Megatron indexed dataset cannot hold an SFT loss mask; "
            "write a dataset directory (--output-format megatronish)"
        )
    out = Path(output).expanduser()
    with nothing_left_on_failure(bin_path(out) if output_format == "megatron" else out):
        if output_format == "megatron":
            return _write_prefix(inputs, out, source, vocab_size, options)
        if source is None:
            return prepare_dataset(inputs, output, vocab_size=vocab_size, **options)
        if source.kind != "megatron":
            raise UserError(
                f"--input {source.path}: already a dataset directory; nothing to convert"
            )
        return _write_directory(source, out, options)


def _dataset_input(
    inputs: list[str], vocab_size: int | None, eod_id: int | None
) -> TokenSource | None:
    """The single --input when it is a Megatron prefix or a prepared dataset directory."""
    prefixes = [p for p in inputs if Path(p).suffix in (".idx", ".bin") and prefix_of(p)]
    prepared = [p for p in inputs if _is_prepared(Path(p).expanduser())]
    if not prefixes and not prepared:
        return None
    if len(inputs) != 1:
        raise UserError("--input: a Megatron prefix or a dataset directory is converted alone")
    if prepared:
        if vocab_size is not None or eod_id is not None:
            raise UserError(f"--vocab-size, --eod-id: {inputs[0]} records its own")
        return open_prepared(inputs[0])
    prefix = prefix_of(prefixes[0])
    assert prefix is not None
    if vocab_size is None or vocab_size < 1:
        raise UserError(
            f"--vocab-size: required (a positive integer) to convert the Megatron prefix {prefix}"
        )
    if eod_id is None or not 0 <= eod_id < vocab_size:
        raise UserError(
            f"--eod-id: required to convert the Megatron prefix {prefix}, an id in "
            f"[0, --vocab-size {vocab_size})"
        )
    data = read_indexed(prefix)
    check_token_ids(data, vocab_size, "--vocab-size")
    split = np.zeros(data.n_docs, dtype=np.uint8)
    return TokenSource(
        prefix, "megatron", data.tokens, data.offsets, split, vocab_size, eod_id, data.sha256
    )


def _is_prepared(path: Path) -> bool:
    try:
        meta = json.loads((path / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _write_prefix(
    inputs: list[str],
    prefix: Path,
    source: TokenSource | None,
    vocab_size: int | None,
    options: dict[str, Any],
) -> Path:
    for path in (bin_path(prefix), idx_path(prefix)):
        if path.exists() or path.is_symlink():
            raise UserError(f"--output {prefix}: {path} already exists; choose another prefix")
    if prefix.is_dir():
        raise UserError(f"--output {prefix}: is a directory; give a prefix such as DIR/name")
    if source is not None:
        write_indexed(prefix, _documents(source), source.vocab_size)
        return prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{prefix.name}.tokens-", dir=prefix.parent))
    try:
        directory = prepare_dataset(
            inputs, str(staging / "dataset"), vocab_size=vocab_size, **options
        )
        tokenized = open_prepared(directory)
        write_indexed(prefix, _documents(tokenized), tokenized.vocab_size)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return prefix


def _documents(source: TokenSource):
    offsets = np.asarray(source.offsets)
    for d in range(len(offsets) - 1):
        yield np.asarray(source.tokens[offsets[d] : offsets[d + 1]])


def _write_directory(source: TokenSource, out: Path, options: dict[str, Any]) -> Path:
    """A Megatron prefix -> a new dataset directory at `out`."""
    val_fraction = options.get("val_fraction", 0.01)
    seed = options.get("seed", 1234)
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction}: must be at least 0 and below 1")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"{out}: output already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        follow_umask(staging)
        meta = _write_tokens(source, staging, val_fraction, seed)
        with open(staging / METADATA_FILE, "w", encoding="utf-8") as handle:
            json.dump(meta, handle, indent=2)
            handle.write("\n")
        if out.is_dir():
            out.rmdir()
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_tokens(
    source: TokenSource, directory: Path, val_fraction: float, seed: int
) -> dict[str, Any]:
    dtype = token_dtype(source.vocab_size)
    digest = hashlib.sha256()
    max_id = -1
    with open(directory / TOKENS_FILE, "wb") as handle:
        for start in range(0, len(source.tokens), _CHUNK):
            chunk = np.asarray(source.tokens[start : start + _CHUNK]).astype(dtype)
            max_id = max(max_id, int(chunk.max()))
            handle.write(memoryview(chunk))
            digest.update(memoryview(chunk))
        handle.flush()
        os.fsync(handle.fileno())
    offsets = np.asarray(source.offsets, dtype=np.int64)
    n_docs = len(offsets) - 1
    if n_docs == 0 or np.any(np.diff(offsets) == 0):
        raise UserError(
            f"{idx_path(source.path)}: the Megatron prefix has no documents or an empty one; "
            "a dataset directory holds non-empty documents (read the prefix in place instead)"
        )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": "megatronish prepare (from a Megatron prefix)",
        "tokenizer": {"kind": "none", "file": None, "source": None, "requested_vocab_size": None},
        "vocab_size": source.vocab_size,
        "eot_id": source.eot_id,
        "dtype": dtype.name,
        **write_documents(directory, offsets, val_fraction, seed),
        "max_token_id": max(max_id, 0),
        "sha256": digest.hexdigest(),
        "builtin": False,
        "sources": [str(source.path)],
        "n_files": 1,
        "skipped_files": 0,
        "skipped_file_names": [],
        "text_bytes": 0,
        "seconds": {"tokenizer_training": 0.0, "encoding": 0.0},
    }
