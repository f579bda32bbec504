"""A run trains only on data of the tokenizer its starting weights come with: a Hugging Face
directory's (checkpoint.init_from_hf) or the resumed checkpoint's, an import's included. `train`
and `launch` refuse data of another in one line naming both, before anything trains (`check`
says it as a note and prints its report); a directory without tokenizer files records none, and
then any data goes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatronish.checkpoint.save import tokenizer_of_dataset
from megatronish.hf.exporter import export_hf
from megatronish.hf.importer import import_hf
from tests.checkpoints import save_single, tiny_cfg
from tests.conftest import CONFIGS, invoke_cli


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> dict:
    """Data of a BPE (bpe) and byte-level data (byte) of one text; a tiny GPT-2 with the BPE's
    vocabulary exported with its tokenizer.json (hf) and imported back (imported)."""
    root = tmp_path_factory.mktemp("start")
    texts = root / "texts"
    texts.mkdir()
    for index in range(5):
        (texts / f"{index}.txt").write_text(f"document {index} of a few words\n" * 20)
    for name, tokenizer in {"bpe": ["bpe", "--vocab-size", "300"], "byte": ["byte"]}.items():
        result = invoke_cli(
            "prepare", "--input", str(texts), "--tokenizer", *tokenizer, "--val-fraction", "0.2",
            "--output", str(root / name),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    vocab = json.loads((root / "bpe" / "metadata.json").read_text())["vocab_size"]
    cfg = tiny_cfg("gpt2", f"model.vocab_size={vocab}")
    save_single(root / "ckpt", cfg, tokenizer=tokenizer_of_dataset(root / "bpe"))
    export_hf(str(root / "ckpt"), str(root / "hf"))
    imported, has_tokenizer = import_hf(str(root / "hf"), str(root / "imported"))
    assert has_tokenizer and (root / "hf" / "tokenizer.json").is_file()
    paths = {name: root / name for name in ("bpe", "byte", "hf")}
    return {"vocab": vocab, "imported": imported, **paths}


def command(name: str, starts: dict, run: Path, *sets: str):
    """`megatronish NAME` (train, launch or check) of the exported model's shape, one step."""
    model = ["model.arch=gpt2", "model.n_layer=2", "model.n_head=4", "model.d_model=64"]
    model += ["model.max_seq_len=64", f"model.vocab_size={starts['vocab']}"]
    train = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4"]
    train += ["train.steps=1", "train.eval_every=0", "train.log_every=1"]
    paths = [f"run.out_dir={run / 'out'}", f"checkpoint.dir={run / 'ck'}"]
    every = [*model, *train, *paths, *sets]
    args = ["--config", str(CONFIGS / "tiny.yaml"), *(a for s in every for a in ("--set", s))]
    return invoke_cli(name, *args)


def assert_refused(name: str, result, run: Path, *needles: str) -> None:
    """train and launch exit 2 in one line; check prints it as a note and exits 0."""
    lines = result.stderr.strip().splitlines()
    status, start = (
        (0, "note: train would refuse this config: ") if name == "check" else (2, "error: ")
    )
    assert result.returncode == status, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{start}data.path: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (run / "out" / "metrics.jsonl").exists() and not (run / "ck").exists()


@pytest.mark.parametrize("name", ["train", "launch", "check"])
def test_data_of_another_tokenizer_than_init_from_hfs_exits_2_naming_both(starts, tmp_path, name):
    hf, byte = starts["hf"], starts["byte"]
    result = command(name, starts, tmp_path, f"checkpoint.init_from_hf={hf}", f"data.path={byte}")
    assert_refused(
        name,
        result,
        tmp_path,
        f"data.path: {byte} uses tokenizer byte (vocab 257, end of text 256) but ",
        f"checkpoint.init_from_hf {hf} has tokenizer file:",
        f"prepare --tokenizer {hf / 'tokenizer.json'}",
    )
    # Data of the directory's own tokenizer (prepared by the BPE it copies) is accepted.
    same = command(
        "check", starts, tmp_path, f"checkpoint.init_from_hf={hf}", f"data.path={starts['bpe']}"
    )
    assert same.returncode == 0, same.stderr


@pytest.mark.parametrize("name", ["train", "launch", "check"])
def test_resuming_an_import_on_data_of_another_tokenizer_exits_2_naming_both(
    starts, tmp_path, name
):
    imported, byte = starts["imported"], starts["byte"]
    result = command(name, starts, tmp_path, f"checkpoint.resume={imported}", f"data.path={byte}")
    assert_refused(
        name,
        result,
        tmp_path,
        f"data.path: {byte} uses tokenizer byte",
        f"but the checkpoint {imported} was trained on tokenizer file:",
    )
    same = command(
        "check", starts, tmp_path, f"checkpoint.resume={imported}", f"data.path={starts['bpe']}"
    )
    assert same.returncode == 0, same.stderr


def test_a_directory_without_tokenizer_files_trains_on_any_data(starts, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(starts["hf"], bare)
    (bare / "tokenizer.json").unlink()
    (bare / "tokenizer_config.json").unlink()
    byte = starts["byte"]  # and a vocabulary larger than the data's is fine
    result = command(
        "train", starts, tmp_path, f"checkpoint.init_from_hf={bare}", f"data.path={byte}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"initialized from {bare}" in result.stdout
