"""`import` copies a Hugging Face directory's tokenizer files, its chat template included, into
the checkpoint beside tokenizer.json, so the tokenizer travels with the model: `prepare --sft
--tokenizer STEP_DIR` then renders the model's own template, and records the model's vocabulary
(an embedding padded past the tokenizer's ids) for train's check."""

from __future__ import annotations

import json

from megatronish.checkpoint.save import TokenizerInfo
from megatronish.data.tokenizer import TOKENIZER_COMPANIONS
from megatronish.hf.exporter import export_hf
from megatronish.hf.importer import import_hf
from tests.checkpoints import save_single, tiny_cfg
from tests.conftest import CONFIGS, invoke_cli
from tests.data.chat_dirs import tokenizer_dir

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "the fox says hi"},
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_import_copies_the_tokenizer_files_and_the_template_travels(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok", "qwen2_5")
    eot = json.loads((tok / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    cfg = tiny_cfg("gpt2", "model.vocab_size=320")
    save_single(
        tmp_path / "ckpt", cfg, tokenizer=TokenizerInfo("file", eot, tok / "tokenizer.json")
    )
    hf = tmp_path / "hf"
    export_hf(str(tmp_path / "ckpt"), str(hf))
    (hf / "tokenizer_config.json").write_bytes((tok / "tokenizer_config.json").read_bytes())
    (hf / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    (hf / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}', encoding="utf-8")
    step_dir, has_tokenizer = import_hf(str(hf), str(tmp_path / "imported"))
    assert has_tokenizer
    for name in (*TOKENIZER_COMPANIONS[:2], TOKENIZER_COMPANIONS[3], "tokenizer.json"):
        assert (step_dir / name).read_bytes() == (hf / name).read_bytes(), name

    records = tmp_path / "chats.jsonl"
    records.write_text(json.dumps({"prompt": "hi", "response": "the fox"}) + "\n")
    result = invoke_cli(
        "prepare", "--sft", "--input", str(records), "--tokenizer", str(step_dir),
        "--val-fraction", "0", "--output", str(tmp_path / "data"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "data" / "metadata.json").read_text())
    assert meta["chat_template_source"] == str(step_dir / "chat_template.jinja")
    assert (tmp_path / "data" / "chat_template.jinja").read_text() == CHATML
    assert meta["tokenizer"]["model_vocab_size"] == 320 and meta["vocab_size"] == 300


def test_the_chat_template_survives_import_train_and_export(tmp_path):
    """The companion files travel from an imported model through prepare, a training run's
    checkpoint and export --format hf: AutoTokenizer on the export renders the conversation as
    on the published directory, token for token."""
    from transformers import AutoTokenizer

    tok = tokenizer_dir(tmp_path / "tok", "qwen2_5")
    eot = json.loads((tok / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    cfg = tiny_cfg("gpt2", "model.vocab_size=320")
    save_single(
        tmp_path / "ckpt", cfg, tokenizer=TokenizerInfo("file", eot, tok / "tokenizer.json")
    )
    published = tmp_path / "published"  # a published model's directory: its own tokenizer files
    export_hf(str(tmp_path / "ckpt"), str(published))
    (published / "tokenizer_config.json").write_bytes((tok / "tokenizer_config.json").read_bytes())
    (published / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}')
    step_dir, _ = import_hf(str(published), str(tmp_path / "imported"))
    records = tmp_path / "chats.jsonl"
    records.write_text(json.dumps({"messages": MESSAGES}) + "\n" * 2, encoding="utf-8")
    result = invoke_cli(
        "prepare", "--sft", "--input", str(records), "--tokenizer", str(step_dir),
        "--val-fraction", "0", "--output", str(tmp_path / "data"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sets = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.max_seq_len=16"]
    sets += ["model.vocab_size=320", f"data.path={tmp_path / 'data'}", "train.seq_len=16"]
    sets += ["train.steps=1", "train.eval_every=0", "train.micro_batch_size=1"]
    sets += ["train.global_batch_size=1", f"run.out_dir={tmp_path / 'run'}"]
    sets += [f"checkpoint.dir={tmp_path / 'trained'}"]
    result = invoke_cli(
        "train", "--config", str(CONFIGS / "tiny.yaml"), *(a for s in sets for a in ("--set", s))
    )
    assert result.returncode == 0, result.stderr[-3000:]
    exported = tmp_path / "exported"
    result = invoke_cli(
        "export", "--checkpoint", str(tmp_path / "trained"), "--output", str(exported)
    )
    assert result.returncode == 0, result.stderr
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (exported / name).read_bytes() == (published / name).read_bytes(), name
    theirs = AutoTokenizer.from_pretrained(str(published))
    ours = AutoTokenizer.from_pretrained(str(exported))
    for generation in (False, True):
        want = theirs.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=generation
        )
        got = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation)
        assert got == want and "<|im_start|>system\nbe brief<|im_end|>" in got
        assert ours(got)["input_ids"] == theirs(want)["input_ids"]
