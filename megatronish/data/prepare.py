"""`prepare`: tokenize a corpus into a dataset directory (layout in dataset.py).

The corpus streams through data.encode in batches of documents, so memory stays flat however
large the corpus. Everything is written into a hidden temporary sibling of the output
directory, renamed into place only once complete: a failed or interrupted prepare leaves
nothing at the output path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatronish.data.chat_template import TEMPLATE_FILE, ChatTemplate
from megatronish.data.corpus import Corpus
from megatronish.data.dataset import (
    FORMAT,
    FORMAT_VERSION,
    LOSS_MASK_FILE,
    METADATA_FILE,
    OFFSETS_FILE,
    SPLIT_FILE,
    SPLITS,
    TOKENIZER_FILE,
    TOKENS_FILE,
    token_dtype,
)
from megatronish.data.encode import encode_corpus
from megatronish.data.preference import PreferenceCorpus, pair_split
from megatronish.data.sft import SFTCorpus
from megatronish.data.template_sft import encode_conversations, load_tokenizer_dir
from megatronish.data.tokenizer import (
    DEFAULT_BPE_VOCAB,
    MIN_BPE_VOCAB,
    ByteTokenizer,
    HFTokenizer,
    check_bpe_vocab_size,
    companion_files,
    load_tokenizer_file,
    train_bpe,
)
from megatronish.errors import UserError
from megatronish.files import follow_umask, write_file

SKIPPED_NAMES = 20  # skipped files named in metadata.json (all are counted)
SKIPPED_SHOWN = 3  # of them, named in prepare's note


@dataclass(frozen=True)
class TokenizerChoice:
    """What --tokenizer resolved to: kind byte | bpe | file, and for file the loaded tokenizer
    (from a tokenizer directory: the directory, its chat template if it has one, and the
    vocab_size of the model beside it if it names one)."""

    kind: str
    bpe_vocab_size: int | None = None
    path: Path | None = None
    loaded: HFTokenizer | None = None
    template: ChatTemplate | None = None
    model_vocab_size: int | None = None
    directory: Path | None = None


def prepare_dataset(
    inputs: list[str],
    output: str,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    glob_pattern: str | None = None,
    jsonl_field: str = "text",
    val_fraction: float = 0.01,
    seed: int = 1234,
    sft: bool = False,
    preference: bool = False,
) -> Path:
    """Tokenizes `inputs` (files, directories, *.jsonl files; none: the built-in corpus) into a
    new dataset directory `output` and returns its path. tokenizer is "byte", "bpe" (trained on
    the corpus with vocab_size ids, default 8192), the path of a tokenizer.json or of a Hugging
    Face tokenizer directory (with sft, its chat template renders the records). Whole
    documents form the validation split: round(n_docs * val_fraction) of them (at least one
    when val_fraction > 0 and there are two or more), drawn by `seed`. sft: every input is SFT
    JSON Lines (sft.py), and the dataset gets a loss mask; preference: every input is preference
    JSON Lines (preference.py), stored as SFT examples in pairs. UserError, with nothing left at
    `output`, for a bad input, an existing non-empty output or a bad option; an OSError (a full
    disk) once the temporary directory is removed (the directories made above `output` are
    the caller's: prepare_any)."""
    out = Path(output).expanduser()
    _check_output_free(out)
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction}: must be at least 0 and below 1")
    if sft and preference:
        raise UserError("--sft, --preference: choose one (preference records hold two responses)")
    if (sft or preference) and (not inputs or jsonl_field != "text"):
        flag = "--preference" if preference else "--sft"
        raise UserError(
            f"{flag}: give the JSON Lines files with --input (records with prompt and response, "
            "or messages; --jsonl-field does not apply)"
        )
    choice = resolve_tokenizer(tokenizer, vocab_size)
    kind = PreferenceCorpus if preference else SFTCorpus if sft else Corpus
    corpus = kind.from_inputs(inputs, glob_pattern, jsonl_field) if inputs else Corpus.builtin()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    with _sigterm_as_interrupt():
        try:
            write_dataset(corpus, staging, choice, val_fraction, seed)
            _check_output_free(out)
            os.rename(staging, out)  # replaces an empty `out` (rename(2))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def resolve_tokenizer(tokenizer: str, vocab_size: int | None) -> TokenizerChoice:
    """Checks --tokenizer and --vocab-size together; a tokenizer file is loaded now, so a bad
    one fails before any work."""
    if tokenizer == "byte":
        if vocab_size is not None:
            raise UserError(
                "--vocab-size: applies to --tokenizer bpe only (the byte tokenizer has 257 ids)"
            )
        return TokenizerChoice("byte")
    if tokenizer == "bpe":
        size = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
        check_bpe_vocab_size(size)
        return TokenizerChoice("bpe", bpe_vocab_size=size)
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise UserError(
            f"--tokenizer {tokenizer}: not byte, bpe, an existing tokenizer.json or a tokenizer "
            "directory"
        )
    if vocab_size is not None:
        raise UserError(f"--vocab-size: a tokenizer file ({path}) brings its own vocabulary")
    if path.is_dir():
        loaded, template, model_vocab = load_tokenizer_dir(path)
        file = (path / TOKENIZER_FILE).resolve()
        return TokenizerChoice("file", None, file, loaded, template, model_vocab, path.resolve())
    return TokenizerChoice("file", path=path.resolve(), loaded=load_tokenizer_file(path))


def write_dataset(
    corpus: Corpus, directory: Path, choice: TokenizerChoice, val_fraction: float, seed: int
) -> dict[str, Any]:
    """Writes every file of a dataset into the existing empty `directory`; returns the
    metadata. The caller renames the directory into place. The directory gets the mode mkdir
    would give it (a staging directory from mkdtemp is private)."""
    follow_umask(directory)
    tok, training_s = _dataset_tokenizer(corpus, directory, choice)
    encoding_started = time.perf_counter()
    dtype = token_dtype(tok.vocab_size)
    sft = isinstance(corpus, SFTCorpus)
    template = choice.template if sft else None
    offsets, max_id, digest, counted = _encode(corpus, tok, directory, dtype, template)
    encoding_s = time.perf_counter() - encoding_started
    n_docs = len(offsets) - 1
    if n_docs == 0:
        skipped = (
            f" ({len(corpus.skipped_files)} binary files skipped)" if corpus.skipped_files else ""
        )
        raise UserError(f"{', '.join(corpus.description)}: no text documents found{skipped}")
    pairs = corpus.write_records(directory) if isinstance(corpus, PreferenceCorpus) else None
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"megatronish {_version()}",
        "tokenizer": _tokenizer_meta(choice),
        "vocab_size": int(tok.vocab_size),
        "eot_id": int(tok.eot_id),
        "dtype": dtype.name,
        **write_documents(directory, offsets, val_fraction, seed, pairs is not None),
        "max_token_id": max_id,
        "sha256": digest,
        "sft": sft,
        "loss_mask": LOSS_MASK_FILE if sft else None,
        "counted_tokens": counted,
        "preference": pairs,
        "chat_template": TEMPLATE_FILE if template is not None else None,
        "chat_template_source": template.name if template is not None else None,
        "builtin": corpus.is_builtin,
        "sources": corpus.description,
        "n_files": len(corpus.sources),
        "skipped_files": len(corpus.skipped_files),
        "skipped_file_names": corpus.skipped_files[:SKIPPED_NAMES],
        "text_bytes": corpus.text_bytes,
        "seconds": {"tokenizer_training": round(training_s, 3), "encoding": round(encoding_s, 3)},
    }
    with open(directory / METADATA_FILE, "w", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    return meta


def _tokenizer_meta(choice: TokenizerChoice) -> dict[str, Any]:
    """metadata.json's "tokenizer": kind, file, source, requested_vocab_size; from a tokenizer
    directory also the directory and the vocab_size of the model beside it (or None)."""
    meta = {
        "kind": choice.kind,
        "file": TOKENIZER_FILE if choice.kind != "byte" else None,
        "source": str(choice.path) if choice.path else None,
        "requested_vocab_size": choice.bpe_vocab_size,
    }
    if choice.directory is not None:
        meta.update(directory=str(choice.directory), model_vocab_size=choice.model_vocab_size)
    return meta


def _encode(
    corpus: Corpus,
    tok: ByteTokenizer | HFTokenizer,
    directory: Path,
    dtype: np.dtype,
    template: ChatTemplate | None,
) -> tuple[np.ndarray, int, str, int]:
    """Writes the tokens (and an SFT corpus's loss mask; with a chat template, the template too)
    into `directory`: (offsets, the largest id, sha256, tokens counted)."""
    mask_path = directory / LOSS_MASK_FILE if isinstance(corpus, SFTCorpus) else None
    if template is None:
        return encode_corpus(corpus, tok, directory / TOKENS_FILE, dtype, mask_path)
    assert isinstance(corpus, SFTCorpus) and isinstance(tok, HFTokenizer) and mask_path
    encoded = encode_conversations(corpus, template, tok, directory / TOKENS_FILE, dtype, mask_path)
    write_file(directory / TEMPLATE_FILE, template.source.encode("utf-8"))
    return encoded


def _dataset_tokenizer(
    corpus: Corpus, directory: Path, choice: TokenizerChoice
) -> tuple[ByteTokenizer | HFTokenizer, float]:
    """(the dataset's tokenizer, the seconds its training took): the byte tokenizer, a BPE
    tokenizer trained on the corpus, or the chosen file; the latter two written into
    `directory` as tokenizer.json (a tokenizer directory's companion files beside it)."""
    started = time.perf_counter()
    training_s = 0.0
    if choice.kind == "byte":
        tok: ByteTokenizer | HFTokenizer = ByteTokenizer()
    elif choice.kind == "bpe":
        tok = train_bpe(corpus.texts(), choice.bpe_vocab_size or DEFAULT_BPE_VOCAB)
        tok.save(directory / TOKENIZER_FILE)
        training_s = time.perf_counter() - started
    else:
        assert choice.loaded is not None and choice.path is not None
        tok = choice.loaded
        shutil.copyfile(choice.path, directory / TOKENIZER_FILE)
        if choice.directory is not None:  # its settings and chat template travel with it
            for path in companion_files(choice.directory):
                shutil.copyfile(path, directory / path.name)
    return tok, training_s


def prepare_notes(meta: dict[str, Any]) -> list[str]:
    """One line each for what a user would not expect of the dataset `meta` describes: a BPE
    vocabulary smaller than asked for and the binary files skipped (the first few named)."""
    notes = []
    asked, got = meta["tokenizer"].get("requested_vocab_size"), meta["vocab_size"]
    if asked is not None and got < asked:
        notes.append(
            f"note: bpe vocabulary {got:,}, not the {asked:,} asked for: after "
            f"{got - MIN_BPE_VOCAB:,} merges every word of the corpus is a single token, so "
            "nothing is left to merge (a larger corpus gives more)"
        )
    skipped, names = meta.get("skipped_files", 0), meta.get("skipped_file_names", [])
    if skipped:
        shown = names[:SKIPPED_SHOWN]
        rest = f" and {skipped - len(shown):,} more" if skipped > len(shown) else ""
        notes.append(
            f"note: skipped {skipped:,} binary files (not UTF-8 text): {', '.join(shown)}{rest}"
        )
    return notes


def write_documents(
    directory: Path, offsets: np.ndarray, val_fraction: float, seed: int, pairs: bool = False
) -> dict[str, Any]:
    """Saves the document offsets and a drawn train/validation split of the documents (with
    pairs, of the preference pairs) into `directory`; returns the metadata entries that count
    them."""
    n_docs = len(offsets) - 1
    if pairs:
        split = pair_split(n_docs, lambda n: split_documents(n, val_fraction, seed))
    else:
        split = split_documents(n_docs, val_fraction, seed)
    np.save(directory / OFFSETS_FILE, offsets)
    np.save(directory / SPLIT_FILE, split)
    is_val = split == SPLITS["val"]
    val_tokens = int(np.diff(offsets)[is_val].sum())
    val_docs = int(np.count_nonzero(is_val))
    return {
        "n_tokens": int(offsets[-1]),
        "n_docs": n_docs,
        "train_tokens": int(offsets[-1]) - val_tokens,
        "train_docs": n_docs - val_docs,
        "val_tokens": val_tokens,
        "val_docs": val_docs,
        "val_fraction": val_fraction,
        "split_seed": seed,
    }


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """uint8 [n_docs], 1 for the round(n_docs * val_fraction) validation documents (at least
    one if val_fraction > 0 and n_docs >= 2, never all), drawn without replacement by seed."""
    n_val = round(n_docs * val_fraction)
    if val_fraction > 0 and n_docs >= 2:
        n_val = max(n_val, 1)
    n_val = min(n_val, max(n_docs - 1, 0))
    flags = np.zeros(n_docs, dtype=np.uint8)
    if n_val:
        chosen = np.random.default_rng(seed).choice(n_docs, size=n_val, replace=False)
        flags[chosen] = SPLITS["val"]
    return flags


def _check_output_free(out: Path) -> None:
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if out.exists() or out.is_symlink():
        raise UserError(
            f"{out}: output already exists and is not an empty directory; "
            "choose another --output or remove it"
        )


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt, so the staging directory is removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatronish")
    except PackageNotFoundError:
        return "unknown"
