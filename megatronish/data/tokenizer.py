"""Tokenizers behind one interface: byte-level (no training) and Hugging Face `tokenizers`
(a BPE trained on the corpus, or any existing tokenizer.json).

Every tokenizer has `encode(text) -> list[int]`, `encode_batch(texts) -> list[list[int]]`,
`decode(ids) -> str`, `decodable_ids()` (the ids decode renders; sampling draws only those),
`vocab_size`, `eot_id` and `name`, plus `encode_arrays(texts)`, the fast path of `prepare`: one
numpy array of ids per text. Decoding renders the end-of-text token as
its text, so decode(encode(t)) == t also when t contains it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from megatronish.errors import UserError

EOT_TOKEN = "<|endoftext|>"
# End-of-text tokens recognised in an existing tokenizer.json, in order of preference.
EOT_CANDIDATES = (EOT_TOKEN, "</s>", "<eos>", "<|end_of_text|>")
DEFAULT_BPE_VOCAB = 8192
MIN_BPE_VOCAB = 257  # the 256 byte symbols of the ByteLevel alphabet plus <|endoftext|>
MAX_VOCAB = 2**31
# The files of a Hugging Face tokenizer directory that travel with its tokenizer.json (settings,
# special tokens, chat template): import, prepare --tokenizer DIR, checkpoints and export copy
# those a directory holds.
TOKENIZER_COMPANIONS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is <|endoftext|>; vocab_size 257.

    decode replaces only invalid UTF-8 sequences (for instance a multi-byte character cut in
    half by sampling) with U+FFFD, so decode(encode(t)) == t for every str t."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """uint8 arrays that view the encoded bytes (no per-byte Python work)."""
        return [np.frombuffer(text.encode("utf-8"), np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.fromiter(ids, dtype=np.int64) if not isinstance(ids, np.ndarray) else ids
        outside = (ids < 0) | (ids > self.eot_id)
        if outside.any():
            bad = int(ids[outside][0])
            raise ValueError(f"token id {bad} is outside the byte vocabulary 0..{self.eot_id}")
        pieces = []
        start = 0
        for eot_position in np.flatnonzero(ids == self.eot_id):
            pieces += [ids[start:eot_position].astype(np.uint8).tobytes(), EOT_TOKEN.encode()]
            start = eot_position + 1
        pieces.append(ids[start:].astype(np.uint8).tobytes())
        return b"".join(pieces).decode("utf-8", errors="replace")

    def decodable_ids(self) -> np.ndarray:
        """0..256: every byte and <|endoftext|>."""
        return np.arange(self.vocab_size)


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with a known end-of-text id.

    encode never adds special tokens (no BOS/EOS from a post-processor): `prepare` appends the
    end-of-text token itself. encode_batch runs on all cores (the library's thread pool)."""

    def __init__(self, tokenizer, eot_id: int, name: str) -> None:
        self.tokenizer = tokenizer
        self.eot_id = eot_id
        self.name = name
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _encodings(self, texts: Sequence[str]):
        fast = getattr(self.tokenizer, "encode_batch_fast", None)  # no offsets: quicker
        encode = fast if fast is not None else self.tokenizer.encode_batch
        return encode(list(texts), add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self._encodings(texts)]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.array(enc.ids, dtype=np.uint32) for enc in self._encodings(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def decodable_ids(self) -> np.ndarray:
        """The ids of the vocabulary's tokens (an id it leaves unused decodes to nothing)."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))


Tokenizer = ByteTokenizer | HFTokenizer


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> HFTokenizer:
    """Trains a byte-level BPE (GPT-2 style pre-tokenizer and decoder, so every text round-trips
    exactly) with <|endoftext|> as special token id 0. `texts` is consumed once, streaming.
    The result may have fewer than vocab_size tokens when the corpus has fewer merges."""
    from tokenizers import Tokenizer as HFCore
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_vocab_size(vocab_size)
    core = HFCore(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(core, core.token_to_id(EOT_TOKEN), name="bpe")


def check_bpe_vocab_size(vocab_size: int) -> None:
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(
            f"--vocab-size {vocab_size}: must be between {MIN_BPE_VOCAB} "
            f"(256 bytes + {EOT_TOKEN}) and {MAX_VOCAB}"
        )


def load_tokenizer_file(path: str | Path, name: str = "file") -> HFTokenizer:
    """Loads a Hugging Face tokenizer.json; its end-of-text token is the first of
    <|endoftext|>, </s>, <eos>, <|end_of_text|> (Llama 3) that it has. UserError naming the file
    otherwise."""
    from tokenizers import Tokenizer as HFCore

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file does not exist")
    try:
        core = HFCore.from_file(str(path))
    except Exception as exc:  # the library raises plain Exception subclasses
        reason = " ".join(str(exc).split())[:200]
        raise UserError(f"{path}: not a Hugging Face tokenizer.json ({reason})") from None
    for token in EOT_CANDIDATES:
        eot_id = core.token_to_id(token)
        if eot_id is not None:
            return HFTokenizer(core, eot_id, name=name)
    candidates = ", ".join(EOT_CANDIDATES)
    raise UserError(f"{path}: the tokenizer has no end-of-text token; it needs one of {candidates}")


def companion_files(directory: Path) -> tuple[Path, ...]:
    """The files of TOKENIZER_COMPANIONS that `directory` holds."""
    return tuple(directory / name for name in TOKENIZER_COMPANIONS if (directory / name).is_file())


def tokenizer_id(kind: str, file: Path | None) -> str | None:
    """What identifies a tokenizer of `kind` (byte, bpe or file; `file` its tokenizer.json):
    "byte", or "KIND:<sha256 of the file>" (copies of one file are one tokenizer, whichever kind
    brought it). None: no tokenizer (kind none, or the file is missing)."""
    if kind == "byte":
        return "byte"
    if kind not in ("bpe", "file") or file is None or not file.is_file():
        return None
    return f"{kind}:{hashlib.sha256(file.read_bytes()).hexdigest()}"


def same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer_id values name one tokenizer (the file's hash decides, not the
    kind)."""
    return a.rpartition(":")[2] == b.rpartition(":")[2]


def tokenizer_label(identity: str) -> str:
    """A tokenizer_id as a message shows it: "byte" or "bpe:<first 12 hex digits>"."""
    kind, _, digest = identity.partition(":")
    return f"{kind}:{digest[:12]}" if digest else kind
