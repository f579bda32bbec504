"""Writes a tiny random Qwen2 model as a published one is laid out (config.json,
model.safetensors, tokenizer.json and tokenizer_config.json with a ChatML chat template), and
optionally a JSON Lines file of chats in its format, so the fine-tuning manual
(docs/fine-tuning.md) runs end to end without a download:

    python scripts/tiny_published_model.py --output tiny-qwen --chats chats.jsonl

The tokenizer is a byte-level BPE trained on the chats' words; the weights are transformers'
random initialization (seed 0), fp32."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NAMES = ["ada", "alan", "grace", "edsger", "barbara", "donald", "ken", "dennis"]
COLOURS = ["red", "green", "blue", "amber", "violet", "teal", "ochre", "white"]


def chats(count: int) -> list[dict]:
    """`count` short conversations (a system message, one or two user turns), seeded."""
    rng, out = random.Random(0), []
    for i in range(count):
        name, colour = rng.choice(NAMES), rng.choice(COLOURS)
        messages = [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": f"What colour does {name} like?"},
            {"role": "assistant", "content": f"{name} likes {colour}."},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": f"And what is {name}'s number?"},
                {"role": "assistant", "content": f"{name}'s number is {i % 97}."},
            ]
        out.append({"messages": messages})
    return out


def write_tokenizer(directory: Path, texts: list[str]) -> int:
    """A byte-level BPE of ~400 tokens trained on texts, with ChatML's special tokens and
    template; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    core.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return core.get_vocab_size()


def write_model(directory: Path, vocab_size: int) -> None:
    """A random Qwen2ForCausalLM: 2 layers, hidden 32, 4 query and 2 key-value heads."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the model directory to write")
    parser.add_argument("--chats", help="a JSON Lines file of chats to write too")
    args = parser.parse_args()
    records = chats(400)
    texts = [m["content"] for r in records for m in r["messages"]]
    out = Path(args.output)
    out.mkdir(parents=True)
    write_model(out, write_tokenizer(out, texts))
    if args.chats:
        lines = [json.dumps(r) for r in records]
        Path(args.chats).parent.mkdir(parents=True, exist_ok=True)
        Path(args.chats).write_text("\n".join(lines) + "\n")
    print(
        f"wrote a tiny Qwen2 model to {out}" + (f" and chats to {args.chats}" if args.chats else "")
    )


if __name__ == "__main__":
    main()
