"""The datasets a run reads through one interface: a directory written by `prepare` or a
Megatron prefix read in place (indexed.py), each with its documents' train / validation / test
split, and the run's list of them with their blend weights (data.path or data.blend).

A TokenSource is tokens [n_tokens] (memory-mapped), offsets int64 [n_docs + 1] (document d is
tokens[offsets[d]:offsets[d + 1]]), split uint8 [n_docs] (0 train, 1 validation, 2 test) and,
for an SFT dataset, loss_mask uint8 [n_tokens] (1: the token counts in the loss as a target).
A prepared directory keeps the split `prepare` drew; a Megatron prefix has none of its own and
takes data.split: contiguous runs of documents in the ratios "train,validation,test", as
megatron-core splits (default "1,0,0": every document trains).

The datasets of one run share a tokenizer (check_shared_tokenizer): a prepared directory's is
named by tokenizer_id (byte, or the hash of its tokenizer.json); a dataset without one of its
own (a Megatron prefix, or a directory converted from one) joins others only when it ends
documents with their end-of-text id and its ids lie in their vocabulary.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatronish.data.cache import resolve_dataset
from megatronish.data.dataset import (
    TOKENIZER_FILE,
    load_documents,
    open_loss_mask,
    open_tokens,
    read_metadata,
)
from megatronish.data.indexed import check_token_ids, prefix_of, read_indexed
from megatronish.data.tokenizer import same_tokenizer, tokenizer_id, tokenizer_label
from megatronish.errors import UserError

if TYPE_CHECKING:
    from megatronish.config import Config

SPLIT_NAMES = ("train", "val", "test")


@dataclass
class TokenSource:
    """One dataset as the loader reads it (see the module docstring for the arrays)."""

    path: Path
    kind: str  # "prepared" | "megatron"
    tokens: np.ndarray
    offsets: np.ndarray
    split: np.ndarray
    vocab_size: int
    eot_id: int
    sha256: str
    meta: dict[str, Any] | None = None  # a prepared directory's metadata.json
    loss_mask: np.ndarray | None = None  # None: every token counts in the loss
    tokenizer: str | None = None  # tokenizer_id; None: no tokenizer of its own
    max_token_id: int | None = None  # the largest id (-1: no tokens; None: not known)

    def docs_in(self, split: str) -> int:
        return int(np.count_nonzero(np.asarray(self.split) == SPLIT_NAMES.index(split)))

    @property
    def records_are_documents(self) -> bool:
        """Whether document masks take the documents from the offsets (an SFT dataset: a chat
        template may write the end-of-text token inside a conversation) rather than end them
        after each end-of-text token, as Megatron does."""
        return self.loss_mask is not None

    def tokenizer_words(self) -> str:
        """What the dataset's ids are tokens of, as a message says it after the path."""
        if self.tokenizer is not None:
            return (
                f"uses tokenizer {tokenizer_label(self.tokenizer)} (vocab {self.vocab_size}, "
                f"end of text {self.eot_id})"
            )
        if self.kind == "megatron":
            return (
                f"is a Megatron prefix without a tokenizer (end of text {self.eot_id} from "
                f"data.eod_id, largest id {self.max_token_id})"
            )
        return (
            f"has no tokenizer of its own (end of text {self.eot_id}, largest id "
            f"{self.max_token_id})"
        )


def open_prepared(directory: str | os.PathLike[str] | None) -> TokenSource:
    """A prepared dataset directory (None: the built-in corpus), every token validated."""
    path = resolve_dataset(directory)
    meta = read_metadata(path, validate=True)
    offsets, split = load_documents(path, meta)
    return TokenSource(
        path=path,
        kind="prepared",
        tokens=open_tokens(path, meta),
        offsets=offsets,
        split=split,
        vocab_size=int(meta["vocab_size"]),
        eot_id=int(meta["eot_id"]),
        sha256=meta["sha256"],
        meta=meta,
        loss_mask=open_loss_mask(path, meta),
        tokenizer=tokenizer_id(meta["tokenizer"]["kind"], path / TOKENIZER_FILE),
        max_token_id=meta["max_token_id"],
    )


def open_megatron(
    prefix: Path, vocab_size: int | None, eod_id: int | None, split: str | None
) -> TokenSource:
    """A Megatron prefix read in place. It carries no vocabulary, so model.vocab_size and
    data.eod_id are required (a UserError names every one missing); every id is checked against
    model.vocab_size."""
    missing = [
        (key, what)
        for key, value, what in (
            ("model.vocab_size", vocab_size, "the tokenizer's vocabulary size"),
            ("data.eod_id", eod_id, "the tokenizer's end-of-document id"),
        )
        if value is None
    ]
    if missing:
        raise UserError(
            f"{', '.join(key for key, _ in missing)}: required for the Megatron prefix {prefix} "
            f"(it records no tokenizer); set {' and '.join(f'{k} to {w}' for k, w in missing)}"
        )
    assert vocab_size is not None and eod_id is not None
    if not 0 <= eod_id < vocab_size:
        raise UserError(f"data.eod_id: {eod_id} must be in [0, model.vocab_size {vocab_size})")
    data = read_indexed(prefix)
    largest = check_token_ids(data, vocab_size, "model.vocab_size")
    flags = split_flags(data.n_docs, split or "1,0,0")
    return TokenSource(
        prefix,
        "megatron",
        data.tokens,
        data.offsets,
        flags,
        vocab_size,
        eod_id,
        data.sha256,
        max_token_id=largest,
    )


def open_source(
    path: str | None,
    vocab_size: int | None = None,
    eod_id: int | None = None,
    split: str | None = None,
) -> TokenSource:
    """data.path (or one blend entry) -> its TokenSource: a Megatron prefix when PATH.idx (or
    PATH itself, ending in .idx / .bin) names one, else a prepared directory."""
    prefix = prefix_of(path) if path is not None else None
    if prefix is not None:
        return open_megatron(prefix, vocab_size, eod_id, split)
    return open_prepared(path)


def parse_split(spec: str, key: str = "data.split") -> list[float]:
    """Ratios "969,30,1" -> [0.969, 0.03, 0.001] (fewer parts: the rest are 0)."""
    parts = [p.strip() for p in str(spec).replace("/", ",").split(",")]
    try:
        ratios = [float(p) for p in parts]
    except ValueError:
        ratios = []
    if not 1 <= len(ratios) <= 3 or any(not r >= 0 for r in ratios) or sum(ratios) <= 0:
        raise UserError(
            f"{key}: {spec!r} is not train,validation,test ratios; use non-negative numbers "
            'with a positive sum, e.g. "969,30,1"'
        )
    ratios += [0.0] * (3 - len(ratios))
    return [r / sum(ratios) for r in ratios]


def split_flags(n_docs: int, spec: str) -> np.ndarray:
    """uint8 [n_docs]: contiguous train, validation and test runs of documents, their
    boundaries at round(cumulative ratio * n_docs) as megatron-core's get_split_indices."""
    bounds = [0]
    for ratio in parse_split(spec):
        bounds.append(bounds[-1] + int(round(ratio * n_docs)))
    bounds = [b - (bounds[-1] - n_docs) if i else 0 for i, b in enumerate(bounds)]
    flags = np.zeros(n_docs, dtype=np.uint8)
    for code in range(3):
        flags[max(bounds[code], 0) : max(bounds[code + 1], 0)] = code
    return flags


@dataclass
class DataPlan:
    """The run's datasets and their sampling weights (a single dataset has weight 1)."""

    sources: list[TokenSource]
    weights: list[float]

    @property
    def blended(self) -> bool:
        return len(self.sources) > 1

    @property
    def vocab_size(self) -> int:
        return max(s.vocab_size for s in self.sources)

    @property
    def tokenizer_source(self) -> TokenSource:
        """The dataset whose tokenizer the run's checkpoints record: the first with one of its
        own (a blend's datasets share it), else the first."""
        return next((s for s in self.sources if s.tokenizer is not None), self.sources[0])

    @property
    def sft(self) -> bool:
        """Whether a dataset holds SFT examples (a loss mask): packed examples must then never
        see each other, so training and eval use document masks."""
        return any(s.loss_mask is not None for s in self.sources)

    def docs_in(self, split: str) -> int:
        return sum(s.docs_in(split) for s in self.sources)


def run_data(cfg: Config, vocab_size: int | None = None) -> tuple[Config, DataPlan]:
    """(cfg as its data settles it, the DataPlan of its data.path or data.blend): every dataset
    opened and checked (a Megatron prefix against vocab_size, default model.vocab_size). What
    the data decides is decided here for training, `check` and `eval` alike, and so for the
    checkpoints' config: SFT examples must never see each other, so SFT data sets
    data.document_mask. cfg itself is not changed: the settled config is a copy (sharing the
    sections it leaves as they are) when it differs."""
    data = cfg.data
    vocab_size = vocab_size if vocab_size is not None else cfg.model.vocab_size
    plan = resolve_data(data.path, data.blend, data.split, vocab_size, data.eod_id)
    for source in plan.sources:
        check_tokenizer_dir_vocab(source, cfg.model.vocab_size)
    if plan.sft and not data.document_mask:
        cfg = replace(cfg, data=replace(data, document_mask=True))
    return cfg, plan


def check_tokenizer_dir_vocab(source: TokenSource, model_vocab: int | None) -> None:
    """UserError naming both sizes when a dataset prepared with a Hugging Face tokenizer
    directory meets a model.vocab_size that is neither the tokenizer's vocabulary nor the one
    of the model the directory's config.json describes (an embedding padded past the
    tokenizer's last id)."""
    tokenizer = (source.meta or {}).get("tokenizer") or {}
    if model_vocab is None or "directory" not in tokenizer:
        return
    sizes = {source.vocab_size, tokenizer.get("model_vocab_size") or source.vocab_size}
    if model_vocab not in sizes:
        valid = " or ".join(str(size) for size in sorted(sizes))
        raise UserError(
            f"model.vocab_size: {model_vocab} differs from the vocabulary of the tokenizer "
            f"directory {tokenizer['directory']} ({valid}) that prepared {source.path}; set "
            f"model.vocab_size={max(sizes)} (null takes {source.vocab_size}), or prepare the "
            "data with the model's own tokenizer directory"
        )


def shared_eod_id(sources: list[TokenSource]) -> int:
    """The end-of-document id of every dataset of the list (data.document_mask finds documents
    by it); a UserError when they differ."""
    ids = sorted({source.eot_id for source in sources})
    if len(ids) > 1:
        names = ", ".join(f"{s.path} ends documents with {s.eot_id}" for s in sources)
        raise UserError(
            f"data.document_mask: the datasets end documents with different ids ({names}); "
            "blend datasets of one tokenizer, or set data.document_mask=false (SFT data always "
            "trains with document masks)"
        )
    return ids[0]


def resolve_data(
    path: str | None,
    blend: Any,
    split: str | None,
    vocab_size: int | None,
    eod_id: int | None,
) -> DataPlan:
    """data.path / data.blend -> the DataPlan (every dataset opened and checked)."""
    if split is not None:
        parse_split(split)
    if blend is None:
        return DataPlan([open_source(path, vocab_size, eod_id, split)], [1.0])
    if path is not None:
        raise UserError("data.blend: set data.blend or data.path, not both")
    entries = parse_blend(blend)
    sources = [open_source(p, vocab_size, eod_id, split) for p, _ in entries]
    check_shared_tokenizer(sources)
    return DataPlan(sources, [w for _, w in entries])


def check_shared_tokenizer(sources: list[TokenSource]) -> None:
    """The datasets of a blend must be tokens of one tokenizer: the same tokenizer_id where they
    have one; a dataset without one of its own must end documents with the others' end-of-text
    id and hold no id beyond a tokenizer's vocabulary. A UserError naming the first two that
    differ otherwise."""
    for index, first in enumerate(sources):
        for other in sources[index + 1 :]:
            if _same_tokens(first, other):
                continue
            rule = "the datasets of one run must share a tokenizer"
            if first.tokenizer is None or other.tokenizer is None:
                rule += " (one without its own must share its end-of-text id and vocabulary)"
            raise UserError(
                f"data.blend: {first.path} {first.tokenizer_words()} but {other.path} "
                f"{other.tokenizer_words()}; {rule}"
            )


def check_trained_tokenizer(
    cfg: Config, sources: list[TokenSource], trained: str | None, model: str, advice: str
) -> None:
    """A UserError naming data.path (data.blend where set) when a dataset's tokenizer is not
    `trained`, the tokenizer_id of a model's tokenizer (`model` says whose, before its label);
    nothing where either records none."""
    key = "data.blend" if cfg.data.blend is not None else "data.path"
    for source in sources:
        if trained is None or source.tokenizer is None:
            continue
        if not same_tokenizer(trained, source.tokenizer):
            raise UserError(
                f"{key}: {source.path} {source.tokenizer_words()} but {model} "
                f"{tokenizer_label(trained)}; {advice}"
            )


def _same_tokens(a: TokenSource, b: TokenSource) -> bool:
    if a.eot_id != b.eot_id:
        return False
    if a.tokenizer is not None and b.tokenizer is not None:
        return same_tokenizer(a.tokenizer, b.tokenizer)
    own, bare = (a, b) if b.tokenizer is None else (b, a)
    if own.tokenizer is None or bare.max_token_id is None:
        return True
    return bare.max_token_id < own.vocab_size


def parse_blend(spec: Any) -> list[tuple[str, float]]:
    """data.blend -> [(path, weight)], weights as given (positive). Accepts Megatron's
    "0.3 PATH_A 0.7 PATH_B" and a list of {path, weight} mappings."""
    if isinstance(spec, str):
        words = spec.split()
        if not words or len(words) % 2:
            raise UserError(
                f'data.blend: {spec!r} is not weight-path pairs; write "0.3 PATH_A 0.7 PATH_B"'
            )
        pairs: list[tuple[Any, Any]] = [(words[i + 1], words[i]) for i in range(0, len(words), 2)]
    elif isinstance(spec, list) and spec:
        pairs = []
        for entry in spec:
            if not isinstance(entry, dict) or set(entry) != {"path", "weight"}:
                raise UserError(
                    f"data.blend: entry {entry!r} must be a mapping with exactly 'path' and "
                    "'weight'"
                )
            pairs.append((entry["path"], entry["weight"]))
    else:
        raise UserError(
            f'data.blend: {spec!r}; write "0.3 PATH_A 0.7 PATH_B" or a list of {{path, weight}}'
        )
    entries = []
    for path, weight in pairs:
        try:
            value = float(weight) if not isinstance(weight, bool) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise UserError(
                f"data.blend: weight {weight!r} of {path} is not a positive number; weights are "
                "positive numbers such as 0.3 (they are normalized to sum to 1)"
            )
        if not isinstance(path, str) or not path:
            raise UserError(f"data.blend: path {path!r} must be a non-empty string")
        entries.append((path, value))
    return entries
