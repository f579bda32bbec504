"""The tokenizer that travels with a model. Export writes a file tokenizer (BPE, tokenizer.json)
with a tokenizer_config.json that transformers' AutoTokenizer reads, or marks a byte-level
model in config.json (transformers has no byte tokenizer class); import takes either back, a
tokenizer.json with its companion files (tokenizer_config.json, the chat template...)."""

from __future__ import annotations

from pathlib import Path

from megatronish.checkpoint.format import TOKENIZER_FILE
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import TokenizerInfo
from megatronish.errors import UserError
from megatronish.files import write_file
from megatronish.hf.files import CONFIG_JSON, json_bytes, read_config_json

BYTE_TOKENIZER_KEY = "megatronish_tokenizer"  # config.json marker of the byte-level tokenizer
# The files that travel with tokenizer.json: its settings, special tokens and chat template.
TOKENIZER_COMPANIONS = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)


def write_tokenizer(ckpt: Checkpoint, out: Path, config: dict, max_seq_len: int) -> str:
    """Writes the checkpoint's tokenizer into the export directory `out` (or marks `config`,
    the config.json to write, byte-level); returns the line saying what was written."""
    info = ckpt.meta.get("tokenizer")
    if info is not None and info["kind"] == "byte":
        config[BYTE_TOKENIZER_KEY] = "byte"
        return (
            "no tokenizer written: the model is byte-level (ids 0-255 are UTF-8 bytes, 256 is "
            "<|endoftext|>), which transformers has no tokenizer class for"
        )
    if info is None or not (ckpt.dir / TOKENIZER_FILE).is_file():
        return "no tokenizer written: the checkpoint records none"
    write_file(out / TOKENIZER_FILE, (ckpt.dir / TOKENIZER_FILE).read_bytes())
    eot = ckpt.tokenizer().tokenizer.id_to_token(info["eot_id"])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "bos_token": eot,
        "eos_token": eot,
    }
    write_file(out / "tokenizer_config.json", json_bytes(tokenizer_config))
    return f"tokenizer: {TOKENIZER_FILE} (end of text {eot!r})"


def read_tokenizer(hf_dir: Path) -> TokenizerInfo | None:
    """The tokenizer of a Hugging Face directory: the byte-level mark of its config.json, or its
    tokenizer.json; None when it has none we read."""
    from megatronish.data import load_tokenizer_file

    has_config = (hf_dir / CONFIG_JSON).is_file()
    if has_config and read_config_json(hf_dir).get(BYTE_TOKENIZER_KEY) == "byte":
        return TokenizerInfo("byte", 256)
    path = hf_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return TokenizerInfo("file", load_tokenizer_file(path).eot_id, path)
    except UserError:
        return None


def copy_tokenizer_companions(hf_dir: Path, step_dir: Path) -> list[str]:
    """Copies the files of TOKENIZER_COMPANIONS that `hf_dir` has into the checkpoint step
    directory beside its tokenizer.json (so `prepare --sft --tokenizer STEP_DIR` renders the
    model's own chat template); returns their names."""
    copied = [name for name in TOKENIZER_COMPANIONS if (hf_dir / name).is_file()]
    for name in copied:
        write_file(step_dir / name, (hf_dir / name).read_bytes())
    return copied
