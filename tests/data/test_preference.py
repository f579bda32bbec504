"""`prepare --preference`: each record becomes two conversations sharing the prompt, in which
only the response (and what the template writes with it) counts, stored so that a pair is one
row of the loader; bad records, and pairs that do not fit train.seq_len, exit 2 with one line
naming the record."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatronish.data.pairs import PairLoader
from megatronish.data.sources import open_prepared
from tests.conftest import invoke_cli
from tests.data.chat_dirs import tokenizer_dir

PROMPT_RECORD = {"prompt": "2+2?", "chosen": "4", "rejected": "five"}
MESSAGES_RECORD = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Sky?"},
    ],
    "chosen": "Blue.",
    "rejected": "Green, I think.",
}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def prepare(tmp_path: Path, records: list, *extra: str):
    source = write_jsonl(tmp_path / "pairs.jsonl", records)
    out = tmp_path / "pairs"
    args = ["prepare", "--preference", "--input", str(source), "--output", str(out), *extra]
    return invoke_cli(*args), out


def documents(directory: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, loss mask) of each document of a prepared dataset."""
    source = open_prepared(directory)
    bounds = zip(source.offsets[:-1], source.offsets[1:])
    return [(np.asarray(source.tokens[a:b]), np.asarray(source.loss_mask[a:b])) for a, b in bounds]


def test_each_record_is_two_conversations_sharing_the_prompt_where_only_the_response_counts(
    tmp_path,
):
    result, out = prepare(tmp_path, [PROMPT_RECORD, MESSAGES_RECORD], "--val-fraction", "0")
    assert result.returncode == 0, result.stderr
    assert "preference: 2 pairs" in result.stdout
    docs = documents(out)
    assert len(docs) == 4
    records = [PROMPT_RECORD, MESSAGES_RECORD]
    for index, (ids, mask) in enumerate(docs):
        response = records[index // 2]["chosen" if index % 2 == 0 else "rejected"]
        # the byte tokenizer: the counted ids are the response's bytes and its end-of-text
        assert bytes(ids[mask == 1][:-1].astype(np.uint8)).decode() == response
        assert ids[mask == 1][-1] == 256 and ids[-1] == 256
    chosen, rejected = docs[2][0], docs[3][0]
    prompt_len = len(chosen) - len("Blue.") - 1
    assert np.array_equal(chosen[:prompt_len], rejected[:prompt_len])  # the shared prompt
    assert b"Hello" in bytes(chosen[:prompt_len].astype(np.uint8))  # a turn of the prompt


def test_the_split_keeps_pairs_whole_and_the_loader_gives_a_pair_per_row(tmp_path):
    records = [dict(PROMPT_RECORD, chosen=str(n)) for n in range(8)]
    result, out = prepare(tmp_path, records, "--val-fraction", "0.25")
    assert result.returncode == 0, result.stderr
    split = np.load(out / "split.npy")
    assert np.array_equal(split[0::2], split[1::2]) and split.sum() == 4  # 2 pairs, 4 docs
    loader = PairLoader(out, "train", 80, 6, 3, 0, 1, seed=1)
    step = loader.next_step_batch()
    assert step.tokens.shape == (2, 3, 81) and len(set(loader.last_pairs)) == 6
    docs = documents(out)
    for row, pair in zip(step.tokens.reshape(6, 81), loader.last_pairs, strict=True):
        chosen, rejected = docs[2 * pair][0], docs[2 * pair + 1][0]
        pair_ids = np.concatenate([chosen, rejected])
        assert np.array_equal(row[: len(pair_ids)].numpy(), pair_ids)
    starts = step.starts.reshape(6, 80)
    assert (starts.sum(-1) == 2).all()  # the rejected conversation and the padding


def test_a_model_template_marks_the_last_response_as_apply_chat_template_writes_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = tokenizer_dir(tmp_path / "qwen", "qwen2_5")
    result, out = prepare(tmp_path, [MESSAGES_RECORD], "--tokenizer", str(directory))
    assert result.returncode == 0, result.stderr
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))

    def template_ids(conversation: list[dict], generation: bool = False) -> list[int]:
        encoded = tok.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=generation
        )
        return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)

    prompt = MESSAGES_RECORD["messages"]
    before = len(template_ids(prompt, generation=True))
    for (ids, mask), key in zip(documents(out), ("chosen", "rejected"), strict=True):
        whole = template_ids([*prompt, {"role": "assistant", "content": MESSAGES_RECORD[key]}])
        assert ids[: len(whole)].tolist() == whole
        want = np.zeros(len(ids), dtype=np.uint8)
        want[before : len(whole)] = 1  # the last turn alone: "Hello" does not count
        assert np.array_equal(mask, want)


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"prompt": "p", "chosen": "a"}, "pairs.jsonl:2: record has no field 'rejected'"),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "pairs.jsonl:2: field 'chosen' must"),
        ({"chosen": "a", "rejected": "b"}, "pairs.jsonl:2: record needs exactly one of"),
    ],
)
def test_a_bad_record_exits_2_with_one_line_naming_its_line_and_leaves_nothing(
    tmp_path, record, says
):
    result, out = prepare(tmp_path, [PROMPT_RECORD, record])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
    assert not out.exists()


def test_a_pair_longer_than_seq_len_exits_2_at_train_naming_its_record(tmp_path):
    long = dict(PROMPT_RECORD, rejected="x" * 40)
    result, out = prepare(tmp_path, [PROMPT_RECORD, long], "--val-fraction", "0")
    assert result.returncode == 0, result.stderr
    sets = [f"data.path={out}", "train.objective=dpo", "train.eval_every=0", "train.seq_len=64"]
    sets += [f"run.out_dir={tmp_path / 'run'}", "checkpoint.save=false", "model.n_layer=1"]
    args = ["train", "--config", "configs/tiny.yaml"] + [a for s in sets for a in ("--set", s)]
    result = invoke_cli(*args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pairs.jsonl:2 has 99 tokens, more than train.seq_len + 1 = 65" in result.stderr
    assert "train.seq_len to at least 98" in result.stderr


def test_dpo_needs_preference_pairs_and_pairs_need_dpo(tmp_path, dataset):
    result, out = prepare(tmp_path, [PROMPT_RECORD], "--val-fraction", "0")
    assert result.returncode == 0, result.stderr
    base = ["train", "--config", "configs/tiny.yaml", "--set", "train.eval_every=0"]
    base += ["--set", f"run.out_dir={tmp_path / 'run'}", "--set", "checkpoint.save=false"]
    lm = invoke_cli(*base, "--set", f"data.path={out}")
    assert lm.returncode == 2 and "set train.objective=dpo" in lm.stderr, lm.stderr
    dpo = invoke_cli(*base, "--set", f"data.path={dataset}", "--set", "train.objective=dpo")
    assert dpo.returncode == 2 and "dpo needs preference pairs" in dpo.stderr, dpo.stderr
    for result in (lm, dpo):
        assert result.stderr.count("\n") == 1
