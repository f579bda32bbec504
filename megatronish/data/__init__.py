"""The data pipeline: `prepare` (text -> token dataset), tokenizers, the built-in corpus cache,
and the dp-sharded batch loader. torch is imported only when a batch is made."""

from megatronish.data.cache import builtin_dataset_dir, cache_root, resolve_dataset
from megatronish.data.dataset import (
    dataset_eot_id,
    dataset_vocab_size,
    load_tokenizer,
    read_metadata,
)
from megatronish.data.loader import BatchLoader
from megatronish.data.prepare import prepare_dataset
from megatronish.data.tokenizer import (
    EOT_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer_file,
    train_bpe,
)

__all__ = [
    "EOT_TOKEN",
    "BatchLoader",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "builtin_dataset_dir",
    "cache_root",
    "dataset_eot_id",
    "dataset_vocab_size",
    "load_tokenizer",
    "load_tokenizer_file",
    "prepare_dataset",
    "read_metadata",
    "resolve_dataset",
    "train_bpe",
]
