"""`megatronish prepare` and dataset errors as a user meets them: exit status 2 (1 for a full disk),
exactly one line on stderr naming the file, no traceback, nothing left at the output path. The
first prepare runs in a real process; the error cases run in this one (invoke_cli), for speed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import invoke_cli
from tests.conftest import run_cli as real_cli
from tests.disk import CAUSE

# Reads a dataset the way the training commands do (resolve_dataset), behind the CLI's own
# UserError handler, until a command that only reads a dataset exists.
READ_DATASET = (
    "import sys; from megatronish.cli.shared import user_errors; "
    "from megatronish.data import resolve_dataset; user_errors(resolve_dataset)(sys.argv[1])"
)


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`megatronish ARGS` in this process, with a cache of the test's own."""
    return invoke_cli(*args, env={"MEGATRONISH_CACHE": str(tmp_path / "cache")})


def assert_user_error(result: subprocess.CompletedProcess, names: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and names in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def assert_nothing_left(parent: Path, expected: set[str]) -> None:
    assert set(os.listdir(parent)) == expected  # no output, no hidden staging directory


def prepare(tmp_path: Path, *inputs: str, extra: tuple[str, ...] = (), real: bool = False):
    args = ["prepare", *(a for path in inputs for a in ("--input", path)), *extra]
    if real:
        env = {"MEGATRONISH_CACHE": str(tmp_path / "cache")}
        return real_cli(*args, "--output", str(tmp_path / "out"), env=env, timeout=120)
    return run_cli(tmp_path, *args, "--output", str(tmp_path / "out"))


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "texts"
    directory.mkdir()
    for index in range(5):
        (directory / f"{index}.txt").write_text(f"document {index} with ünïcode ✓\n" * 20)
    return directory


def test_prepare_writes_a_readable_dataset(tmp_path, text_dir):
    result = prepare(tmp_path, str(text_dir), extra=("--val-fraction", "0.2"), real=True)
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert (meta["n_docs"], meta["val_docs"]) == (5, 1)
    checked = subprocess.run([sys.executable, "-c", READ_DATASET, str(tmp_path / "out")])
    assert checked.returncode == 0


def test_prepare_says_when_bpe_gives_fewer_tokens_than_asked_and_names_skipped_binaries(
    tmp_path, text_dir
):
    blobs = sorted(str(text_dir / f"blob{index}.bin") for index in range(5))
    for blob in blobs:
        Path(blob).write_bytes(b"\x00\xff" * 100)
    result = prepare(tmp_path, str(text_dir), extra=("--tokenizer", "bpe", "--vocab-size", "512"))
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    vocab = meta["vocab_size"]
    assert vocab < 512 and meta["tokenizer"]["requested_vocab_size"] == 512
    assert sorted(meta["skipped_file_names"]) == blobs and meta["skipped_files"] == 5
    bpe, skipped = [line for line in result.stdout.splitlines() if line.startswith("note: ")]
    assert bpe.startswith(f"note: bpe vocabulary {vocab}, not the 512 asked for: after ")
    assert "nothing is left to merge" in bpe
    head = "note: skipped 5 binary files (not UTF-8 text): "
    assert skipped.startswith(head) and skipped.endswith(" and 2 more")
    named = skipped.removeprefix(head).removesuffix(" and 2 more").split(", ")
    assert len(named) == 3 and set(named) <= set(blobs)


def test_missing_input_path(tmp_path):
    result = prepare(tmp_path, str(tmp_path / "no_such_dir"))
    assert_user_error(result, str(tmp_path / "no_such_dir"))
    assert_nothing_left(tmp_path, set())


def test_empty_input_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_user_error(prepare(tmp_path, str(tmp_path / "empty")), str(tmp_path / "empty"))
    assert_nothing_left(tmp_path, {"empty"})


def test_binary_input_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(bytes(range(256)) * 4)
    result = prepare(tmp_path, str(tmp_path / "model.bin"))
    assert_user_error(result, str(tmp_path / "model.bin"))
    assert_nothing_left(tmp_path, {"model.bin"})


def test_directory_of_only_binary_files(tmp_path):
    (tmp_path / "bins").mkdir()
    (tmp_path / "bins" / "a.bin").write_bytes(b"\x00\xff" * 100)
    assert_user_error(prepare(tmp_path, str(tmp_path / "bins")), str(tmp_path / "bins"))
    assert_nothing_left(tmp_path, {"bins"})


def test_jsonl_records_without_the_field(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    result = prepare(tmp_path, str(path))
    assert_user_error(result, f"{path}:2")
    assert "content" in result.stderr and "--jsonl-field" in result.stderr
    assert_nothing_left(tmp_path, {"data.jsonl"})


def test_jsonl_that_is_not_json(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    assert_user_error(prepare(tmp_path, str(path)), f"{path}:2")
    assert_nothing_left(tmp_path, {"data.jsonl"})


def test_existing_non_empty_output(tmp_path, text_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    assert_user_error(prepare(tmp_path, str(text_dir)), str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == ["precious.txt"]
    assert_nothing_left(tmp_path, {"out", "texts"})


@pytest.mark.parametrize(
    "extra, names",
    [
        (("--tokenizer", "wordpiece"), "--tokenizer wordpiece"),
        (("--tokenizer", "bpe", "--vocab-size", "100"), "--vocab-size 100"),
        (("--vocab-size", "1000"), "--vocab-size"),
        (("--val-fraction", "1.5"), "--val-fraction 1.5"),
    ],
)
def test_bad_options(tmp_path, text_dir, extra, names):
    assert_user_error(prepare(tmp_path, str(text_dir), extra=extra), names)
    assert_nothing_left(tmp_path, {"texts"})


def test_tokenizer_file_that_is_not_a_tokenizer(tmp_path, text_dir):
    (tmp_path / "tok.json").write_text('{"hello": 1}')
    result = prepare(tmp_path, str(text_dir), extra=("--tokenizer", str(tmp_path / "tok.json")))
    assert_user_error(result, str(tmp_path / "tok.json"))
    assert_nothing_left(tmp_path, {"texts", "tok.json"})


@pytest.fixture(scope="module")
def big_inputs(tmp_path_factory) -> dict[str, Path]:
    """216 kB of text (432 kB of 2-byte tokens: more than a full disk takes), as a text file, a
    dataset directory and a Megatron prefix."""
    root = tmp_path_factory.mktemp("big-inputs")
    text = root / "big.txt"
    text.write_text("a line of text to tokenize\n" * 8000)
    for output in (
        ("--output", root / "dataset"),
        ("--output-format", "megatron", "--output", root / "prefix"),
    ):
        assert invoke_cli("prepare", "--input", str(text), *map(str, output)).returncode == 0
    return {"text": text, "dataset": root / "dataset", "prefix": root / "prefix.idx"}


def assert_full_disk_line(result: subprocess.CompletedProcess, named: Path) -> None:
    """Exit status 1 and one line naming `named`, the cause and the space free."""
    assert result.returncode == 1, result.stdout[-500:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert re.fullmatch(
        rf"error: cannot write {named}: {CAUSE} \(\S+ \S+ free on /\S*"
        r"(, the file-size limit \(ulimit -f\) is \S+ kB)?\)",
        line,
    ), line


@pytest.mark.parametrize(
    "source, output, extra, named",
    [
        ("text", "data", (), "data"),
        ("text", "made/for/it", ("--output-format", "megatron"), "made/for/it.bin"),
        ("dataset", "prefix", ("--output-format", "megatron"), "prefix.bin"),
        ("prefix", "made/for/it", ("--vocab-size", "257", "--eod-id", "256"), "made/for/it"),
    ],
)
def test_prepare_on_a_full_disk_exits_1_in_one_line_and_leaves_nothing(
    big_inputs, full_disk, source, output, extra, named
):
    args = ("--input", str(big_inputs[source]), *extra, "--output", str(full_disk.root / output))
    assert_full_disk_line(full_disk.run("prepare", *args), full_disk.root / named)
    assert full_disk.leftovers() == []  # made/for/ too: the directories it made for its output


@pytest.fixture
def dataset(tmp_path, text_dir) -> Path:
    assert prepare(tmp_path, str(text_dir)).returncode == 0
    return tmp_path / "out"


def read_dataset(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", READ_DATASET, str(path)], capture_output=True, text=True, timeout=60
    )


def test_token_id_beyond_the_vocabulary(dataset):
    tokens = np.fromfile(dataset / "tokens.bin", dtype=np.uint16)
    tokens[-3] = 257  # the byte vocabulary is 0..256
    tokens.tofile(dataset / "tokens.bin")
    result = read_dataset(dataset)
    assert_user_error(result, str(dataset / "tokens.bin"))
    assert "257" in result.stderr


def test_truncated_token_file(dataset):
    data = (dataset / "tokens.bin").read_bytes()
    (dataset / "tokens.bin").write_bytes(data[: len(data) // 2])
    assert_user_error(read_dataset(dataset), str(dataset / "tokens.bin"))


def test_corrupt_metadata(dataset):
    (dataset / "metadata.json").write_text('{"format": "megatronish-tokens"')
    assert_user_error(read_dataset(dataset), str(dataset / "metadata.json"))


# The datasets of one run share a tokenizer

CONFIG = "configs/tiny.yaml"
TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=4", "model.max_seq_len=16"]
TINY += ["train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4"]
TINY += ["train.steps=2", "train.eval_every=0", "train.eval_steps=1"]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> dict[str, Path]:
    """One text prepared byte-level, as a BPE, and with that BPE's tokenizer.json (kind file)."""
    root = tmp_path_factory.mktemp("tokenizers")
    texts = root / "texts"
    texts.mkdir()
    for index in range(5):
        (texts / f"{index}.txt").write_text(f"document {index} with ünïcode ✓\n" * 20)
    tokenizers = {"byte": ["byte"], "bpe": ["bpe", "--vocab-size", "300"]}
    tokenizers["file"] = [str(root / "bpe" / "tokenizer.json")]  # the BPE's, prepared first
    for name, tokenizer in tokenizers.items():
        result = invoke_cli(
            "prepare", "--input", str(texts), "--tokenizer", *tokenizer, "--val-fraction", "0.2",
            "--output", str(root / name),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    paths = {name: root / name for name in tokenizers}
    return paths


def command(tmp_path: Path, name: str, *sets: str) -> subprocess.CompletedProcess:
    """`megatronish NAME` of the tiny config with these settings, in this process."""
    every = [*TINY, f"run.out_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}", *sets]
    target = ["--checkpoint", str(tmp_path / "ck")] if name == "eval" else ["--config", CONFIG]
    return run_cli(tmp_path, name, *target, *(a for s in every for a in ("--set", s)))


def test_a_blend_of_a_byte_and_a_bpe_dataset_exits_2_naming_both_in_train_and_check(
    tmp_path, tokenized
):
    byte, bpe = tokenized["byte"], tokenized["bpe"]
    digest = hashlib.sha256((bpe / "tokenizer.json").read_bytes()).hexdigest()
    vocab = json.loads((bpe / "metadata.json").read_text())["vocab_size"]
    expected = (
        f"error: data.blend: {byte} uses tokenizer byte (vocab 257, end of text 256) but {bpe} "
        f"uses tokenizer bpe:{digest[:12]} (vocab {vocab}, end of text 0); the datasets of one "
        "run must share a tokenizer"
    )
    for name in ("train", "check"):
        result = command(tmp_path, name, f"data.blend=0.5 {byte} 0.5 {bpe}")
        assert_user_error(result, str(bpe))
        assert result.stderr.strip() == expected
    assert not (tmp_path / "run").exists()


def test_a_blend_of_one_tokenizer_trains_and_eval_refuses_data_of_another(tmp_path, tokenized):
    # The BPE and the dataset prepared with its tokenizer.json are one tokenizer.
    bpe, file = tokenized["bpe"], tokenized["file"]
    result = command(tmp_path, "train", f"data.blend=0.5 {bpe} 0.5 {file}")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = tmp_path / "ck" / "step_000002" / "tokenizer.json"
    assert saved.read_bytes() == (bpe / "tokenizer.json").read_bytes()
    assert command(tmp_path, "eval").returncode == 0
    mixed = command(tmp_path, "eval", f"data.blend=0.5 {bpe} 0.5 {tokenized['byte']}")
    assert_user_error(mixed, f"data.blend: {bpe} uses tokenizer bpe:")
    other = command(tmp_path, "eval", f"data.path={tokenized['byte']}")
    assert_user_error(other, f"data.path: {tokenized['byte']} uses tokenizer byte")
    assert f"the checkpoint {tmp_path / 'ck'}" in other.stderr
