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
    offsets = array("q", [0])
    position = 0  # tokens written so far, including the current batch
    doc_len = 0  # tokens of the document in progress
    max_id = -1
    counted_tokens = 0
    digest = hashlib.sha256()
    with contextlib.ExitStack() as files:
        handle = files.enter_context(open(path, "wb"))
        masks = files.enter_context(open(mask_path, "wb")) if mask_path is not None else None
        for batch, arrays in _encoded_batches(corpus, tok):
            parts, mask_parts = [], []
            for ids, (_, ends_document, counted) in zip(arrays, batch, strict=True):
                if len(ids):
                    parts.append(ids)
                    if masks is not None:
                        mask_parts.append(np.full(len(ids), counted, dtype=np.uint8))
                    doc_len += len(ids)
                    position += len(ids)
                if ends_document and doc_len:
                    parts.append(eot)
                    if masks is not None:
                        mask_parts.append(np.ones(1, dtype=np.uint8))
                    position += 1
                    offsets.append(position)
                    doc_len = 0
            if not parts:
                continue
            chunk = np.concatenate(parts)
            max_id = max(max_id, int(chunk.max()))
            if max_id >= tok.vocab_size:
                raise RuntimeError(f"tokenizer {tok.name} produced id {max_id} >= {tok.vocab_size}")
            chunk = chunk.astype(dtype, copy=False)
            handle.write(memoryview(chunk))
            digest.update(memoryview(chunk))
            if masks is None:
                counted_tokens += len(chunk)
            else:
                mask = np.concatenate(mask_parts)
                masks.write(memoryview(mask))
                counted_tokens += int(mask.sum(dtype=np.int64))
        for opened in (handle, masks):
            if opened is not None:
                opened.flush()
                os.fsync(opened.fileno())
    return np.frombuffer(offsets, dtype=np.int64).copy(), max_id, digest.hexdigest(), counted_tokens


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
