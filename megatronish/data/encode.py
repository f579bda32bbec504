"""Encoding a corpus into tokens.bin: the corpus streams through in batches of documents; each
batch is encoded (byte tokenizer: numpy views of the UTF-8 bytes; BPE: `encode_batch` on the
library's thread pool) and appended to tokens.bin (and, for SFT JSON Lines, each piece's
counted flag to loss_mask.bin), so memory stays flat however large the corpus."""

from __future__ import annotations

import contextlib
import hashlib
import os
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from megatronish.data.corpus import Corpus
from megatronish.data.tokenizer import ByteTokenizer, HFTokenizer

BATCH_CHARS = 4 << 20  # characters of text encoded per batch
BATCH_PIECES = 4096  # documents (pieces) encoded per batch


def encode_corpus(
    corpus: Corpus,
    tok: ByteTokenizer | HFTokenizer,
    path: Path,
    dtype: np.dtype,
    mask_path: Path | None = None,
) -> tuple[np.ndarray, int, str, int]:
    """Appends every document's ids and an end-of-text id to `path`, batch by batch, and with
    mask_path each token's loss-mask byte there (a piece's counted flag; 1 for the end-of-text);
    returns (offsets int64 [n_docs + 1], the largest id, sha256 of the file, tokens counted in
    the loss: all of them without a mask)."""
    eot = np.array([tok.eot_id], dtype=dtype)
    doc_len = 0  # tokens of the document in progress
    masked = mask_path is not None
    with TokenOutput.open(path, mask_path, tok) as out:
        for batch, arrays in _encoded_batches(corpus, tok):
            parts, mask_parts = [], []
            end = out.position  # where the batch's ids so far end
            for ids, (_, ends_document, counted) in zip(arrays, batch, strict=True):
                if len(ids):
                    parts.append(ids)
                    if masked:
                        mask_parts.append(np.full(len(ids), counted, dtype=np.uint8))
                    doc_len += len(ids)
                    end += len(ids)
                if ends_document and doc_len:
                    parts.append(eot)
                    if masked:
                        mask_parts.append(np.ones(1, dtype=np.uint8))
                    end += 1
                    out.document_ends.append(end)
                    doc_len = 0
            if parts:
                out.append(np.concatenate(parts).astype(dtype, copy=False), mask_parts)
    return out.result()


class TokenOutput:
    """tokens.bin (and loss_mask.bin) being written: chunks of ids appended in order, with the
    largest id, the file's sha256 and the counted tokens kept as they pass; document_ends holds
    the offsets, the caller appending each document's end as a token count."""

    def __init__(self, handle: BinaryIO, masks: BinaryIO | None, tok: ByteTokenizer | HFTokenizer):
        self.handle, self.masks, self.tok = handle, masks, tok
        self.document_ends = array("q", [0])
        self.position = 0  # tokens written so far
        self.max_id = -1
        self.counted = 0
        self.digest = hashlib.sha256()

    @classmethod
    @contextlib.contextmanager
    def open(
        cls, path: Path, mask_path: Path | None, tok: ByteTokenizer | HFTokenizer
    ) -> Iterator[TokenOutput]:
        """The output over new files at path (and mask_path), flushed to disk on leaving."""
        with contextlib.ExitStack() as files:
            handle = files.enter_context(open(path, "wb"))
            masks = files.enter_context(open(mask_path, "wb")) if mask_path is not None else None
            yield cls(handle, masks, tok)
            for opened in (handle, masks):
                if opened is not None:
                    opened.flush()
                    os.fsync(opened.fileno())

    def append(self, chunk: np.ndarray, mask_parts: list[np.ndarray]) -> None:
        """Appends the ids `chunk` and, with a mask file, the concatenated mask_parts."""
        self.max_id = max(self.max_id, int(chunk.max()))
        if self.max_id >= self.tok.vocab_size:
            raise RuntimeError(
                f"tokenizer {self.tok.name} produced id {self.max_id} >= {self.tok.vocab_size}"
            )
        self.handle.write(memoryview(chunk))
        self.digest.update(memoryview(chunk))
        self.position += len(chunk)
        if self.masks is None:
            self.counted += len(chunk)
        else:
            mask = np.concatenate(mask_parts)
            self.masks.write(memoryview(mask))
            self.counted += int(mask.sum(dtype=np.int64))

    def result(self) -> tuple[np.ndarray, int, str, int]:
        """(offsets int64 [n_docs + 1], the largest id, sha256 of the ids, tokens counted)."""
        offsets = np.frombuffer(self.document_ends, dtype=np.int64).copy()
        return offsets, self.max_id, self.digest.hexdigest(), self.counted


def _encoded_batches(
    corpus: Corpus, tok: ByteTokenizer | HFTokenizer
) -> Iterator[tuple[list[tuple[str, bool, bool]], list[np.ndarray]]]:
    """(batch of pieces, their id arrays), in order. A worker thread encodes one batch while
    this thread reads the next one from disk and the caller writes the previous one (the BPE
    encoder releases the GIL and runs on all cores)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        pending = None
        for batch in _batches(corpus.pieces()):
            future = pool.submit(tok.encode_arrays, [text for text, _, _ in batch])
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (batch, future)
        if pending is not None:
            yield pending[0], pending[1].result()


def _batches(
    pieces: Iterator[tuple[str, bool, bool]],
) -> Iterator[list[tuple[str, bool, bool]]]:
    batch: list[tuple[str, bool, bool]] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if chars >= BATCH_CHARS or len(batch) >= BATCH_PIECES:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch
