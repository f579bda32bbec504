"""Reading a dataset directory written by `prepare`, and checking that it is whole.

Layout of a dataset directory:

    metadata.json   what the rest holds (see prepare.py for the keys)
    tokens.bin      every document's tokens, each followed by the end-of-text token; uint16
                    when the vocabulary fits in 65536 ids, else uint32; little-endian
    offsets.npy     int64 [n_docs + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
    split.npy       uint8 [n_docs]: 0 train, 1 validation
    loss_mask.bin   uint8 [n_tokens], SFT datasets only (metadata "loss_mask"): 1 where the
                    token, as a target, counts in the loss (a response token or the end-of-text
                    that closes the response), 0 elsewhere
    tokenizer.json  the Hugging Face tokenizer (BPE and file tokenizers only; a dataset
                    converted from a Megatron prefix has tokenizer kind "none" and no file),
                    with, from a tokenizer directory, its companion files
                    (tokenizer.TOKENIZER_COMPANIONS: tokenizer_config.json, the chat template...)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from megatronish.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer_file
from megatronish.errors import UserError, read_json_object

FORMAT = "megatronish-tokens"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
SPLIT_FILE = "split.npy"
LOSS_MASK_FILE = "loss_mask.bin"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = {"train": 0, "val": 1}
TOKENIZER_KINDS = ("byte", "bpe", "file", "none")
_INT_KEYS = (
    "vocab_size",
    "eot_id",
    "n_tokens",
    "n_docs",
    "train_tokens",
    "train_docs",
    "val_tokens",
    "val_docs",
    "max_token_id",
)
_SCAN_CHUNK = 1 << 24  # tokens checked at a time by the validating scan
# Datasets whose full scan already passed in this process: (path, size, mtime, sha256).
_validated: set[tuple[str, int, int, str]] = set()


_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits in 16 bits, else little-endian uint32."""
    return _DTYPES["uint16"] if vocab_size <= 1 << 16 else _DTYPES["uint32"]


def read_metadata(dataset_dir: str | Path, validate: bool = False) -> dict[str, Any]:
    """The dataset's metadata.json, after checking that the directory is a whole dataset: the
    metadata parses and has every key, the token file holds exactly n_tokens ids, and the
    offsets, split and loss mask (if any) files match the counts. validate=True also scans
    every token (in chunks, memory-mapped) for an id beyond the vocabulary, and the loss mask
    for a value other than 0 or 1; a scan that passed is not repeated in the same process.
    Every problem is a UserError naming the file."""
    directory = Path(dataset_dir).expanduser()
    if not directory.exists():
        raise UserError(f"{directory}: dataset directory does not exist")
    if not directory.is_dir():
        raise UserError(f"{directory}: not a directory; a dataset is a directory from `prepare`")
    meta = _load_metadata_json(directory / METADATA_FILE)
    tokens_path = directory / TOKENS_FILE
    if not tokens_path.is_file():
        raise UserError(f"{tokens_path}: token file is missing")
    itemsize = _DTYPES[meta["dtype"]].itemsize
    size = tokens_path.stat().st_size
    if size != meta["n_tokens"] * itemsize:
        raise UserError(
            f"{tokens_path}: token file is {size} bytes, expected {meta['n_tokens'] * itemsize} "
            f"({meta['n_tokens']} tokens of {meta['dtype']}); it is truncated or corrupt"
        )
    offsets, split = load_documents(directory, meta)
    mask_path = _loss_mask_path(directory, meta)
    if mask_path is not None and (
        not mask_path.is_file() or mask_path.stat().st_size != meta["n_tokens"]
    ):
        raise UserError(
            f"{mask_path}: the loss mask must be a file of n_tokens = {meta['n_tokens']} bytes; "
            "it is missing, truncated or corrupt (prepare the dataset again)"
        )
    if meta["tokenizer"]["kind"] in ("bpe", "file") and not (directory / TOKENIZER_FILE).is_file():
        raise UserError(f"{directory / TOKENIZER_FILE}: tokenizer file is missing")
    if validate:
        _validate_documents(directory, meta, offsets, split)
        _scan_tokens(tokens_path, meta, mask_path)
    return meta


def load_documents(directory: Path, meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n_docs + 1], split uint8 [n_docs]), memory-mapped, shapes checked."""
    arrays = []
    for name, length, dtype in (
        (OFFSETS_FILE, meta["n_docs"] + 1, np.int64),
        (SPLIT_FILE, meta["n_docs"], np.uint8),
    ):
        path = directory / name
        if not path.is_file():
            raise UserError(f"{path}: file is missing from the dataset")
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise UserError(f"{path}: not a readable .npy file ({exc})") from None
        if array.dtype != dtype or array.shape != (length,):
            raise UserError(
                f"{path}: holds {array.dtype} {list(array.shape)}, expected "
                f"{np.dtype(dtype)} [{length}] for {meta['n_docs']} documents"
            )
        arrays.append(array)
    return arrays[0], arrays[1]


def open_tokens(dataset_dir: str | Path, meta: dict[str, Any]) -> np.ndarray:
    """The token file as a read-only memory map [n_tokens]."""
    path = Path(dataset_dir) / TOKENS_FILE
    if meta["n_tokens"] == 0:
        return np.zeros(0, dtype=_DTYPES[meta["dtype"]])
    return np.memmap(path, dtype=_DTYPES[meta["dtype"]], mode="r", shape=(meta["n_tokens"],))


def open_loss_mask(dataset_dir: str | Path, meta: dict[str, Any]) -> np.ndarray | None:
    """The loss mask as a read-only memory map uint8 [n_tokens], or None for a dataset without
    one (every token counts)."""
    path = _loss_mask_path(Path(dataset_dir), meta)
    if path is None:
        return None
    if meta["n_tokens"] == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(meta["n_tokens"],))


def load_tokenizer(dataset_dir: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer the dataset was prepared with (for decoding samples, `generate`)."""
    meta = read_metadata(dataset_dir)
    kind = meta["tokenizer"]["kind"]
    if kind == "byte":
        return ByteTokenizer()
    if kind == "none":
        raise UserError(
            f"{dataset_dir}: converted from a Megatron prefix, the dataset has no tokenizer to "
            "encode or decode text with"
        )
    tokenizer = load_tokenizer_file(Path(dataset_dir) / TOKENIZER_FILE, name=kind)
    if tokenizer.eot_id != meta["eot_id"]:
        raise UserError(
            f"{Path(dataset_dir) / TOKENIZER_FILE}: end-of-text id {tokenizer.eot_id} differs "
            f"from eot_id {meta['eot_id']} in {METADATA_FILE}"
        )
    return tokenizer


def dataset_vocab_size(dataset_dir: str | Path) -> int:
    """Ids in the dataset are in [0, vocab_size); model.vocab_size must be at least this."""
    return int(read_metadata(dataset_dir)["vocab_size"])


def dataset_eot_id(dataset_dir: str | Path) -> int:
    """The id of the end-of-text token that follows every document."""
    return int(read_metadata(dataset_dir)["eot_id"])


def _load_metadata_json(path: Path) -> dict[str, Any]:
    meta = read_json_object(path, "the directory is not a dataset written by `prepare`")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; "
            f"this megatronish reads {FORMAT!r} version {FORMAT_VERSION} (prepare it again)"
        )
    for key in _INT_KEYS:
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UserError(f"{path}: key '{key}' must be a non-negative integer, got {value!r}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise UserError(f"{path}: key 'dtype' must be uint16 or uint32, got {meta.get('dtype')!r}")
    if _DTYPES[meta["dtype"]] != token_dtype(meta["vocab_size"]):
        raise UserError(
            f"{path}: dtype {meta['dtype']} does not fit vocab_size {meta['vocab_size']}"
        )
    tokenizer = meta.get("tokenizer")
    if not isinstance(tokenizer, dict) or tokenizer.get("kind") not in TOKENIZER_KINDS:
        raise UserError(f"{path}: key 'tokenizer.kind' must be one of {', '.join(TOKENIZER_KINDS)}")
    if not isinstance(meta.get("sha256"), str):
        raise UserError(f"{path}: key 'sha256' must be a string")
    if meta["eot_id"] >= meta["vocab_size"] or meta["max_token_id"] >= max(meta["vocab_size"], 1):
        raise UserError(f"{path}: eot_id or max_token_id is beyond vocab_size {meta['vocab_size']}")
    if meta["train_tokens"] + meta["val_tokens"] != meta["n_tokens"] or (
        meta["train_docs"] + meta["val_docs"] != meta["n_docs"]
    ):
        raise UserError(f"{path}: train and val counts do not add up to n_tokens and n_docs")
    return meta


def _loss_mask_path(directory: Path, meta: dict[str, Any]) -> Path | None:
    name = meta.get("loss_mask")
    if name is None:
        return None
    if name != LOSS_MASK_FILE:
        raise UserError(
            f"{directory / METADATA_FILE}: key 'loss_mask' must be {LOSS_MASK_FILE!r} or null, "
            f"got {name!r}"
        )
    return directory / name


def _validate_documents(
    directory: Path, meta: dict[str, Any], offsets: np.ndarray, split: np.ndarray
) -> None:
    path = directory / OFFSETS_FILE
    if offsets[0] != 0 or offsets[-1] != meta["n_tokens"] or np.any(np.diff(offsets) <= 0):
        raise UserError(f"{path}: offsets must rise from 0 to n_tokens {meta['n_tokens']}")
    n_val = int(np.count_nonzero(split == SPLITS["val"]))
    if np.any(split > 1) or n_val != meta["val_docs"]:
        raise UserError(f"{directory / SPLIT_FILE}: flags must be 0/1 with {meta['val_docs']} ones")


def _scan_tokens(tokens_path: Path, meta: dict[str, Any], mask_path: Path | None) -> None:
    stat = tokens_path.stat()
    key = (str(tokens_path.resolve()), stat.st_size, stat.st_mtime_ns, meta["sha256"])
    if key in _validated:
        return
    tokens = open_tokens(tokens_path.parent, meta)
    vocab_size = meta["vocab_size"]
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        if int(chunk.max()) >= vocab_size:
            index = start + int(np.argmax(chunk >= vocab_size))
            raise UserError(
                f"{tokens_path}: token id {int(tokens[index])} at index {index} is beyond the "
                f"vocabulary (vocab_size {vocab_size} in {METADATA_FILE})"
            )
    if mask_path is not None:
        _scan_loss_mask(mask_path, meta)
    _validated.add(key)


def _scan_loss_mask(mask_path: Path, meta: dict[str, Any]) -> None:
    mask = open_loss_mask(mask_path.parent, meta)
    for start in range(0, len(mask), _SCAN_CHUNK):
        chunk = mask[start : start + _SCAN_CHUNK]
        if int(chunk.max()) > 1:
            index = start + int(np.argmax(chunk > 1))
            raise UserError(f"{mask_path}: value {int(mask[index])} at index {index} is not 0 or 1")
