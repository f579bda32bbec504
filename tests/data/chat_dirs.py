"""Tiny Hugging Face tokenizer directories for chat template tests: a byte-level BPE trained on
a few words (deterministic), the special tokens a template needs as added special tokens, and
a tokenizer_config.json holding a published template (tests/fixtures/chat_templates)."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WORDS = "the quick brown fox says hello to the user and the assistant again brief"

# name -> (template file, special tokens, the named special tokens of tokenizer_config.json)
FAMILIES = {
    "qwen2_5": (
        "qwen2_5.jinja",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    ),
    "llama3_1": (
        "llama3_1.jinja",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
        + ["<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "mistral_v0_2": (
        "mistral_v0_2.jinja",
        ["<unk>", "<s>", "</s>"],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    ),
    "mistral_v0_3": (
        "mistral_v0_3.jinja",
        ["<unk>", "<s>", "</s>"],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    ),
}


def tokenizer_dir(directory: Path, family: str, template: str | None = None) -> Path:
    """Writes the tokenizer directory of `family` (template: this template text instead of the
    family's; "" for none) and returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    file, specials, named = FAMILIES[family]
    directory.mkdir(parents=True)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([WORDS] * 3, trainer=trainer)
    core.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **named}
    text = (TEMPLATES / file).read_text(encoding="utf-8") if template is None else template
    if text:
        config["chat_template"] = text
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
