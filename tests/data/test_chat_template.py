"""`prepare --sft --tokenizer DIR` renders each record with the directory's own chat template:
the token ids and the counted positions are transformers' apply_chat_template's and the rule
(for each assistant message i, the tokens of render(messages[:i+1]) past those of
render(messages[:i], add_generation_prompt=True)), for Qwen2.5's ChatML, Llama 3.1's and
Mistral's templates, with system messages and multi-turn conversations. A template that reaches
outside its sandbox is exit 2 naming it; one that fails on a record, or is not prefix-stable,
exit 2 naming the record; nothing is left behind. A directory without a template keeps the
built-in one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatronish.data.dataset import LOSS_MASK_FILE, TOKENS_FILE
from tests.conftest import CONFIGS, invoke_cli
from tests.data.chat_dirs import tokenizer_dir

SYSTEM = {"role": "system", "content": "be brief"}
RECORDS = [
    {"messages": [SYSTEM, {"role": "user", "content": "hello there"}]
     + [{"role": "assistant", "content": "the fox says hi"}]
     + [{"role": "user", "content": "again?"}, {"role": "assistant", "content": " quick brown\n"}]},
    {"prompt": "say hello", "response": "hello to the user"},
    {"messages": [SYSTEM, {"role": "user", "content": "the user"}]
     + [{"role": "assistant", "content": "and the assistant"}]},
]  # fmt: skip
PREPARED = ("qwen2_5", "llama3_1", "mistral_v0_2")


def messages_of(record: dict) -> list[dict]:
    if "messages" in record:
        return record["messages"]
    return [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["response"]},
    ]


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def prepare(tokenizer: Path, records: Path, output: Path):
    return invoke_cli(
        "prepare", "--sft", "--input", str(records), "--tokenizer", str(tokenizer),
        "--val-fraction", "0", "--output", str(output),
    )  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict:
    """family -> (tokenizer directory, dataset directory, prepare's stdout)."""
    root = tmp_path_factory.mktemp("chat")
    records = write_records(root / "chats.jsonl", RECORDS)
    out = {}
    for family in PREPARED:
        directory = tokenizer_dir(root / family, family)
        result = prepare(directory, records, root / f"{family}-data")
        assert result.returncode == 0, result.stderr
        out[family] = (directory, root / f"{family}-data", result.stdout)
    return out


def transformers_example(directory: Path, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(apply_chat_template's ids of the conversation, the counted positions by the rule)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))

    def ids(conversation: list[dict], generation: bool = False) -> list[int]:
        encoded = tok.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=generation
        )
        return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)

    counted = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            counted += range(len(ids(messages[:i], True)), len(ids(messages[: i + 1])))
    return ids(messages), counted


@pytest.mark.parametrize("family", PREPARED)
def test_ids_and_counted_positions_are_apply_chat_templates(prepared, family):
    directory, data, stdout = prepared[family]
    meta = json.loads((data / "metadata.json").read_text())
    tokens = np.fromfile(data / TOKENS_FILE, dtype=meta["dtype"])
    mask = np.fromfile(data / LOSS_MASK_FILE, dtype=np.uint8)
    offsets = np.load(data / "offsets.npy")
    assert meta["chat_template"] == "chat_template.jinja" and meta["n_docs"] == len(RECORDS)
    for d, record in enumerate(RECORDS):
        ids, counted = transformers_example(directory, messages_of(record))
        document = tokens[offsets[d] : offsets[d + 1]].tolist()
        if ids[-1] != meta["eot_id"]:  # the uncounted end-of-document token
            assert document[-1] == meta["eot_id"] and mask[offsets[d + 1] - 1] == 0
            document = document[:-1]
        assert document == ids
        assert np.flatnonzero(mask[offsets[d] : offsets[d] + len(ids)]).tolist() == counted
    assert "count in the loss" in stdout and int(mask.sum()) == meta["counted_tokens"]


def test_document_masks_keep_each_conversation_one_document_though_it_holds_end_of_text(prepared):
    """Mistral's </s> ends every assistant message: the two-turn record holds it inside, and
    still the segments of the batch that training computes are one per record."""
    from megatronish.data import BatchLoader
    from megatronish.distributed.layout import ParallelState
    from megatronish.training.batches import next_batch

    _, data, stdout = prepared["mistral_v0_2"]
    meta = json.loads((data / "metadata.json").read_text())
    offsets = np.load(data / "offsets.npy")
    tokens = np.fromfile(data / TOKENS_FILE, dtype=meta["dtype"])
    assert (tokens == meta["eot_id"]).sum() > len(RECORDS), "an end-of-text inside a record"
    seq_len = meta["n_tokens"] - 1  # one sample: every record, in order
    loader = BatchLoader(data, "train", seq_len, 1, 1, 0, 1, seed=0)
    _, _, documents, _ = next_batch(loader, ParallelState.single(), document_mask=True)
    record = np.searchsorted(offsets, np.arange(seq_len), side="right") - 1
    assert documents.segments.flatten().tolist() == record.tolist()
    assert documents.positions.flatten().tolist() == (np.arange(seq_len) - offsets[record]).tolist()
    assert "note:" not in stdout


def test_a_blend_takes_the_sft_datasets_documents_from_its_records_and_the_others_at_eot(
    prepared, tmp_path
):
    """A blend of the Mistral dataset (each record begins with <s>, id 1, and holds </s>, id 2,
    inside) and a Megatron prefix whose documents begin with an id the Mistral dataset never
    uses and end with id 2: a document starts exactly at each <s> and at each such id, never
    after an inner </s>."""
    from megatronish.data.blend import BlendLoader
    from megatronish.data.indexed import write_indexed
    from megatronish.data.sources import open_megatron, open_prepared

    _, data, _ = prepared["mistral_v0_2"]
    sft = open_prepared(data)
    first = max(set(range(3, 300)) - set(np.asarray(sft.tokens).tolist()))
    rng = np.random.default_rng(0)
    bodies = [rng.integers(3, first, rng.integers(3, 12)) for _ in range(9)]
    write_indexed(tmp_path / "plain", [np.concatenate(([first], b, [2])) for b in bodies], 300)
    plain = open_megatron(tmp_path / "plain", 300, 2, None)
    loader = BlendLoader([sft, plain], [0.5, 0.5], "train", 16, 16, 16, 0, 1, seed=0)
    step = loader.next_step_batch()
    inputs = step.tokens[..., :-1]
    begins = (inputs == 1) | (inputs == first)
    begins[..., 0] = False
    assert torch.equal(step.starts, begins)
    assert ((inputs[..., :-1] == 2) & ~begins[..., 1:]).any(), "an inner </s> ends no document"
    assert (inputs == first).any() and (inputs == 1).any(), "rows of both datasets"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% import 'os' as os %}{{ os }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
    ],
    ids=["class", "globals", "import", "namespace"],
)
def test_a_template_reaching_outside_its_sandbox_exits_2_naming_the_template(tmp_path, template):
    directory = tokenizer_dir(tmp_path / "tok", "qwen2_5", template=template)
    records = write_records(tmp_path / "chats.jsonl", RECORDS)
    result = prepare(directory, records, tmp_path / "out")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {directory / 'tokenizer_config.json'} (chat_template): ")
    assert "reaches outside its sandbox" in lines[0]
    assert not (tmp_path / "out").exists() and sorted(tmp_path.iterdir()) == [
        tmp_path / "chats.jsonl",
        tmp_path / "tok",
    ]


def test_a_template_failing_on_a_record_exits_2_naming_the_record_and_the_error(tmp_path):
    directory = tokenizer_dir(tmp_path / "tok", "mistral_v0_2")
    turns = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    bad = {"messages": [*turns, {"role": "assistant", "content": "the fox"}]}
    records = write_records(tmp_path / "chats.jsonl", [RECORDS[1], bad])
    result = prepare(directory, records, tmp_path / "out")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0] == (
        f"error: {records}:2: the chat template {directory / 'tokenizer_config.json'} "
        "(chat_template) fails on this record: After the optional system message, conversation "
        "roles must alternate user/assistant/user/assistant/..."
    )
    assert not (tmp_path / "out").exists()


def test_a_template_that_is_not_prefix_stable_exits_2_naming_the_record(tmp_path):
    """Mistral v0.3 puts the system message into the last user message: rendering the
    assistant's reply moves it."""
    directory = tokenizer_dir(tmp_path / "tok", "mistral_v0_3")
    records = write_records(tmp_path / "chats.jsonl", [RECORDS[1], RECORDS[2]])
    result = prepare(directory, records, tmp_path / "out")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {records}:2: the chat template ")
    assert "is not prefix-stable: rendering message 3 (the assistant's)" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_directory_without_a_template_keeps_the_built_in_one(tmp_path, prepared):
    directory = tokenizer_dir(tmp_path / "tok", "qwen2_5", template="")
    records = write_records(tmp_path / "chats.jsonl", RECORDS)
    by_dir = prepare(directory, records, tmp_path / "dir")
    by_file = prepare(directory / "tokenizer.json", records, tmp_path / "file")
    assert by_dir.returncode == by_file.returncode == 0, by_dir.stderr + by_file.stderr
    meta = json.loads((tmp_path / "dir" / "metadata.json").read_text())
    assert meta["chat_template"] is None and meta["tokenizer"]["directory"] == str(directory)
    for name in (TOKENS_FILE, LOSS_MASK_FILE):
        assert (tmp_path / "dir" / name).read_bytes() == (tmp_path / "file" / name).read_bytes()


def test_train_refuses_a_model_vocab_other_than_the_tokenizer_directorys_naming_both(
    prepared, tmp_path
):
    """The data's tokenizer directory has 300 ids (and no config.json of a model with more)."""
    _, data, _ = prepared["qwen2_5"]
    sets = ["model.arch=gpt2", "model.n_layer=1", "model.n_head=2", "model.d_model=32"]
    sets += ["model.max_seq_len=32", "model.vocab_size=320", f"data.path={data}"]
    sets += ["train.seq_len=16", "train.steps=1", "train.eval_every=0"]
    sets += [f"run.out_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}"]
    result = invoke_cli(
        "train", "--config", str(CONFIGS / "tiny.yaml"), *(a for s in sets for a in ("--set", s))
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        "error: model.vocab_size: 320 differs from the vocabulary of the tokenizer directory "
        f"{prepared['qwen2_5'][0]} (300) that prepared {data}; set model.vocab_size=300"
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_template_environment_is_apply_chat_templates(tmp_path):
    """Generation blocks, tojson without HTML escaping, loop controls, dict(), strftime_now and
    the special tokens render as in transformers; of a list of named templates, 'default'."""
    from transformers import AutoTokenizer

    from megatronish.data.chat_template import load_chat_template

    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}"
        "{{ eos_token }}{% endgeneration %}{% else %}U: {{ m.content }}\n{% endif %}{% endfor %}"
        "{{ {'a': '<b>'} | tojson }}{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}"
        "{{ x }}{% endfor %}{{ dict(a=1).a }}{{ strftime_now('%Y')[:0] }}"
    )
    directory = tokenizer_dir(tmp_path / "tok", "qwen2_5", template=template)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "unused"},
        {"name": "default", "template": template},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    messages = messages_of(RECORDS[0])
    ours = load_chat_template(directory).render(messages, add_generation_prompt=False)
    theirs = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, tokenize=False
    )
    assert ours == theirs and '{"a": "<b>"}1' in ours
