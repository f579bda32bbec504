"""Checksums of checkpoint files, and reading a shard file once while checking it.

Every shard file's CRC-32C (Castagnoli) is computed on the bytes as they are written and recorded
in metadata.json as files[NAME]["crc32c"] (8 hex digits); a checkpoint saved before that has no
such key and loads with a one-line note that it cannot be verified. CRC-32C detects every
error burst of up to 32 bits (so any flipped byte) and runs on the processor's CRC instruction
(SSE4.2, ARMv8) at several GB/s per core, several times zlib.crc32; scripts/bench_checkpoint.py
measures what checking costs next to a save and a load.

A file is checked as it is read: it is memory-mapped once (its pages brought in with one
call), a second thread computes the CRC-32C of the mapped bytes while the loader copies
tensors out of the same pages, and the loader waits for the verdict before it returns
(Checkpoint.verify), so the bytes come from the disk once and the check overlaps the copying.
"""

from __future__ import annotations

import json
import mmap
import sys
from pathlib import Path

import torch
from crc32c import crc32c

from megatronish.errors import UserError

CHECKSUM_KEY = "crc32c"
CHUNK_BYTES = 8 << 20
_MADV_POPULATE_READ = 22  # Linux's value; Python 3.11's mmap module does not name it
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_announced: set[str] = set()


class CorruptCheckpoint(UserError):
    """A checkpoint file that is not what metadata.json recorded (missing, another size,
    unreadable, another checksum); `path` is that file."""

    def __init__(self, path: Path, message: str):
        super().__init__(f"{path}: {message}")
        self.path = Path(path)


def checksum_text(data, value: int = 0) -> str:
    """The CRC-32C of bytes-like data (continuing from `value`), as 8 hex digits."""
    return f"{crc32c(data, value):08x}"


def is_checksum(value) -> bool:
    """Whether value is a recorded checksum: 8 lower-case hex digits."""
    return (
        isinstance(value, str) and len(value) == 8 and all(c in "0123456789abcdef" for c in value)
    )


def mismatch(path: Path, actual: str, expected: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        path,
        f"checksum mismatch (crc32c {actual}, metadata.json records {expected}): the file is "
        "corrupt",
    )


def map_file(path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    """File `path` memory-mapped privately (copy-on-write: writing to the tensors never changes
    the file), its pages brought in at once (populate), and its bytes as a uint8 tensor over
    the map."""
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    populate(mapped)
    return mapped, torch.frombuffer(mapped, dtype=torch.uint8)


def populate(mapped: mmap.mmap) -> None:
    """Maps all the file's pages in one call (Linux 5.14+ MADV_POPULATE_READ, from the page
    cache or the disk) instead of one page fault at a time, several times faster for a file
    read whole; elsewhere nothing."""
    if sys.platform != "linux":
        return
    try:
        mapped.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError):  # an older kernel: the pages fault in as they are read
        pass


def checksum_of(mapped: mmap.mmap) -> str:
    """The CRC-32C of a mapped file, as 8 hex digits, chunk by chunk with the GIL released
    (it runs in a second thread, beside the loader)."""
    view = memoryview(mapped)
    value = 0
    for start in range(0, len(view), CHUNK_BYTES):
        value = crc32c(view[start : start + CHUNK_BYTES], value)
    return f"{value:08x}"


def parse_safetensors(buffer: torch.Tensor, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, as views of `buffer` (a copy only for a tensor
    whose offset is not a multiple of its element size)."""
    try:
        header_len = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
        header = json.loads(buffer[8 : 8 + header_len].numpy().tobytes())
        start = 8 + header_len
        tensors = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES[entry["dtype"]]
            begin, end = (start + offset for offset in entry["data_offsets"])
            if not start <= begin <= end <= buffer.numel():
                raise ValueError(f"tensor '{name}' lies outside the file")
            raw = buffer[begin:end]
            if begin % dtype.itemsize:
                raw = raw.clone()
            tensors[name] = raw.view(dtype).view(entry["shape"])
        return tensors
    except (ValueError, KeyError, TypeError, RuntimeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(path, f"not a readable safetensors file ({exc})") from None


def announce_unverifiable(step_dir: Path, main_process: bool) -> None:
    """The one-line note (once per checkpoint and process, on the main process) that a
    checkpoint saved before checksums were recorded cannot be verified."""
    key = str(step_dir)
    if key in _announced or not main_process:
        return
    _announced.add(key)
    print(
        f"note: {step_dir}: saved without checksums (by an older megatronish); its files cannot "
        "be verified",
        file=sys.stderr,
        flush=True,
    )


def first_message_of_ranks(message: str | None, world_size: int) -> str | None:
    """The first of the ranks' messages (None: none has one), on every rank: an all-gather over
    the default group, so every rank of the run must call it."""
    if world_size == 1:
        return message
    import torch.distributed as dist

    messages: list = [None] * world_size
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m is not None), None)
