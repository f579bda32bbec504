"""Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`, megatron-core's MMapIndexedDataset
format): reading one in place, checked against its data file, and writing one.

`PREFIX.bin` holds every sequence's token ids back to back. `PREFIX.idx`, little-endian:

    magic         9 bytes  b"MMIDIDX\\x00\\x00"
    version       uint64   1
    dtype code    uint8    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
                           8 uint16
    n_sequences   uint64
    n_doc_index   uint64   document_indices entries (documents + 1)
    lengths       int32  [n_sequences]   tokens of each sequence
    pointers      int64  [n_sequences]   byte offset of each sequence in PREFIX.bin
    doc_indices   int64  [n_doc_index]   0, then the sequence count after each document

Here, as in megatron-core's GPTDataset, each sequence is one document. Writing follows
megatron-core's builder: uint16 ids when the vocabulary has fewer than 65500, else int32.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatronish.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_INTEGER_CODES = (1, 2, 3, 4, 5, 8)
_UINT16_BELOW = 65500  # megatron-core's DType.optimal_dtype threshold


def prefix_of(path: str | os.PathLike[str]) -> Path | None:
    """The Megatron prefix `path` names (PREFIX, PREFIX.idx or PREFIX.bin, with PREFIX.idx on
    disk), or None when it names none."""
    p = Path(path).expanduser()
    if p.suffix in (".idx", ".bin") and p.with_suffix(".idx").is_file():
        return p.with_suffix("")
    if Path(f"{p}.idx").is_file() and not p.is_dir():
        return p
    return None


def idx_path(prefix: Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: Path) -> Path:
    return Path(f"{prefix}.bin")


def megatron_dtype(vocab_size: int) -> np.dtype:
    """The id dtype megatron-core's builder picks for a vocabulary of vocab_size ids."""
    return np.dtype(np.uint16 if vocab_size < _UINT16_BELOW else np.int32)


@dataclass
class IndexedDataset:
    """A Megatron prefix opened for reading: tokens memory-mapped [n_tokens], document d is
    tokens[offsets[d]:offsets[d + 1]] (offsets int64 [n_docs + 1]). sha256 is of the .idx file
    (it fixes every document's length and place) and the .bin size."""

    prefix: Path
    tokens: np.ndarray
    offsets: np.ndarray
    sha256: str

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1


def read_indexed(prefix: Path) -> IndexedDataset:
    """Opens PREFIX.idx and PREFIX.bin and checks they belong together: the header, the array
    sizes, sequences back to back and exactly filling PREFIX.bin. A UserError names the file
    and what is wrong."""
    index_file, data_file = idx_path(prefix), bin_path(prefix)
    if not data_file.is_file():
        raise UserError(f"{data_file}: data file of the Megatron prefix {prefix} is missing")
    raw = index_file.read_bytes()
    damaged = f"{index_file}: not a Megatron index (MMIDIDX version 1)"
    if len(raw) < _HEADER or raw[: len(MAGIC)] != MAGIC:
        raise UserError(f"{damaged}: bad header")
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, len(MAGIC))
    if version != VERSION or code not in _INTEGER_CODES:
        raise UserError(f"{damaged}: version {version}, dtype code {code} (integer ids needed)")
    expected = _HEADER + n_seq * 4 + n_seq * 8 + n_doc * 8
    if len(raw) not in (expected, expected + n_seq):  # + int8 modes when multimodal
        raise UserError(
            f"{damaged}: {len(raw)} bytes, expected {expected} for {n_seq} sequences and "
            f"{n_doc} document indices; it is truncated or damaged"
        )
    dtype = np.dtype(DTYPE_CODES[code]).newbyteorder("<")
    lengths = np.frombuffer(raw, np.int32, n_seq, _HEADER).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, n_seq, _HEADER + n_seq * 4)
    doc_indices = np.frombuffer(raw, np.int64, n_doc, _HEADER + n_seq * 12)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    if np.any(lengths < 0) or not np.array_equal(pointers, offsets[:-1] * dtype.itemsize):
        raise UserError(f"{damaged}: sequence pointers are not the running sum of the lengths")
    rising = n_doc >= 1 and doc_indices[0] == 0 and doc_indices[-1] == n_seq
    if not rising or np.any(np.diff(doc_indices) < 0):
        raise UserError(f"{damaged}: document indices must rise from 0 to {n_seq}")
    size = data_file.stat().st_size
    if size != offsets[-1] * dtype.itemsize:
        raise UserError(
            f"{data_file}: {size} bytes, but {index_file} describes {int(offsets[-1])} tokens of "
            f"{dtype.name} ({int(offsets[-1]) * dtype.itemsize} bytes); they do not match"
        )
    if offsets[-1] == 0:
        tokens = np.zeros(0, dtype=dtype)
    else:
        tokens = np.memmap(data_file, dtype=dtype, mode="r", shape=(int(offsets[-1]),))
    digest = hashlib.sha256(raw)
    digest.update(str(size).encode())
    return IndexedDataset(prefix, tokens, offsets, digest.hexdigest())


def check_token_ids(data: IndexedDataset, vocab_size: int, key: str) -> int:
    """The largest id of the prefix (-1: no tokens); UserError naming the .bin and `key` for an
    id outside [0, vocab_size)."""
    chunk_len = 1 << 24
    largest = -1
    for start in range(0, len(data.tokens), chunk_len):
        chunk = data.tokens[start : start + chunk_len]
        bad = (chunk >= vocab_size) | (chunk < 0)
        if bad.any():
            index = start + int(np.argmax(bad))
            raise UserError(
                f"{bin_path(data.prefix)}: token id {int(data.tokens[index])} at index {index} is "
                f"outside [0, {key} {vocab_size}); set {key} above the largest id"
            )
        largest = max(largest, int(chunk.max()))
    return largest


def write_indexed(prefix: Path, documents: Iterable[np.ndarray], vocab_size: int) -> int:
    """Writes PREFIX.bin and PREFIX.idx, one sequence (and document) per array; returns the
    document count. Both files are written under temporary names and renamed at the end, so a
    failure leaves nothing at the prefix."""
    dtype = megatron_dtype(vocab_size)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    staged: list[Path] = []
    try:
        lengths: list[int] = []
        fd, tmp = tempfile.mkstemp(prefix=f".{prefix.name}.bin.tmp-", dir=prefix.parent)
        staged.append(Path(tmp))
        with os.fdopen(fd, "wb") as handle:
            for doc in documents:
                handle.write(np.asarray(doc).astype(dtype.newbyteorder("<"), copy=False).tobytes())
                lengths.append(len(doc))
            handle.flush()
            os.fsync(handle.fileno())
        code = {np.dtype(v): k for k, v in DTYPE_CODES.items()}[dtype]
        sizes = np.array(lengths, dtype=np.int64)
        pointers = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) * dtype.itemsize
        fd, tmp = tempfile.mkstemp(prefix=f".{prefix.name}.idx.tmp-", dir=prefix.parent)
        staged.append(Path(tmp))
        with os.fdopen(fd, "wb") as handle:
            handle.write(MAGIC + struct.pack("<QBQQ", VERSION, code, len(sizes), len(sizes) + 1))
            handle.write(sizes.astype("<i4").tobytes())
            handle.write(pointers.astype("<i8").tobytes())
            handle.write(np.arange(len(sizes) + 1, dtype="<i8").tobytes())
            handle.flush()
            os.fsync(handle.fileno())
        mode = 0o666 & ~_umask()
        for path in staged:
            os.chmod(path, mode)
        os.rename(staged[0], bin_path(prefix))
        os.rename(staged[1], idx_path(prefix))
    except BaseException:
        for path in staged:
            path.unlink(missing_ok=True)
        if staged and not idx_path(prefix).exists():
            bin_path(prefix).unlink(missing_ok=True)
        raise
    return len(lengths)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
