"""The tokenizer that travels with a model. Export writes a file tokenizer (BPE, tokenizer.json)
with a tokenizer_config.json that transformers' AutoTokenizer reads, or marks a byte-level
model in config.json (transformers has no byte tokenizer class); import takes either back, a
tokenizer.json with its companion files (data.tokenizer.TOKENIZER_COMPANIONS: tokenizer_config.json,
the chat template...). The companions travel through prepare, training's checkpoints and export,
so transformers' AutoTokenizer on an export renders the model's own chat template."""

from __future__ import annotations

from pathlib import Path

from megatronish.checkpoint.format import TOKENIZER_FILE
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import TokenizerInfo
from megatronish.data.tokenizer import companion_files
from megatronish.errors import UserError
from megatronish.files import write_file
from megatronish.hf.files import CONFIG_JSON, json_bytes, read_config_json

BYTE_TOKENIZER_KEY = "megatronish_tokenizer"  # config.json marker of the byte-level tokenizer
TOKENIZER_CONFIG = "tokenizer_config.json"


def write_tokenizer(ckpt: Checkpoint, out: Path, config: dict, max_seq_len: int) -> str:
    """Writes the checkpoint's tokenizer into the export directory `out` (or marks `config`,
    the config.json to write, byte-level): tokenizer.json, its companion files, and a
    tokenizer_config.json that names the end-of-text token where the checkpoint has none of
    its own; returns the line saying what was written."""
    info = ckpt.meta.get("tokenizer")
    if info is not None and info["kind"] == "byte":
        config[BYTE_TOKENIZER_KEY] = "byte"
        return (
            "no tokenizer written: the model is byte-level (ids 0-255 are UTF-8 bytes, 256 is "
            "<|endoftext|>), which transformers has no tokenizer class for"
        )
    if info is None or not (ckpt.dir / TOKENIZER_FILE).is_file():
        return "no tokenizer written: the checkpoint records none"
    companions = companion_files(ckpt.dir)
    for path in (ckpt.dir / TOKENIZER_FILE, *companions):
        write_file(out / path.name, path.read_bytes())
    eot = ckpt.tokenizer().tokenizer.id_to_token(info["eot_id"])
    if not (ckpt.dir / TOKENIZER_CONFIG).is_file():
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_seq_len,
            "bos_token": eot,
            "eos_token": eot,
        }
        write_file(out / TOKENIZER_CONFIG, json_bytes(tokenizer_config))
    names = ", ".join(path.name for path in (ckpt.dir / TOKENIZER_FILE, *companions))
    return f"tokenizer: {names} (end of text {eot!r})"


def read_tokenizer(hf_dir: Path) -> TokenizerInfo | None:
    """The tokenizer of a Hugging Face directory: the byte-level mark of its config.json, or its
    tokenizer.json with its companion files; None when it has none we read."""
    from megatronish.data import load_tokenizer_file

    has_config = (hf_dir / CONFIG_JSON).is_file()
    if has_config and read_config_json(hf_dir).get(BYTE_TOKENIZER_KEY) == "byte":
        return TokenizerInfo("byte", 256)
    path = hf_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return TokenizerInfo(
            "file", load_tokenizer_file(path).eot_id, path, companion_files(hf_dir)
        )
    except UserError:
        return None
