"""Every checkpoint file's checksum is recorded when it is written and checked on every load:
one flipped byte in the tensor data of a model, optimizer or RNG file (its size unchanged)
makes eval, generate, export, convert, load_model and a resume stop with exit status 2 and
one line naming the file; a resume under checkpoint.resume=auto also names the newest intact
older checkpoint and trains nothing. A checkpoint saved before checksums were recorded still
loads, with one line saying it cannot be verified."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatronish import load_model
from megatronish.errors import UserError
from tests.conftest import CONFIGS, invoke_cli

FILES = {
    "model": "model_tp00.safetensors",
    "optimizer": "optim_tp00_dp000.safetensors",
    "rng": "rng_rank00000.safetensors",
}
TINY = [
    "model.n_layer=2", "model.n_head=4", "model.d_model=32", "model.max_seq_len=64",
    "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.eval_every=0", "train.eval_steps=1", "train.log_every=1",
]  # fmt: skip


def train_args(data: Path, checkpoints: Path, out: Path, *extra: str) -> list[str]:
    sets = TINY + [f"data.path={data}", f"checkpoint.dir={checkpoints}", f"run.out_dir={out}"]
    return ["train", "--config", str(CONFIGS / "tiny.yaml")] + [
        arg for value in [*sets, *extra] for arg in ("--set", value)
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, small_dataset) -> Path:
    """The checkpoint.dir of a tiny 2-step run that saved after each step (step_000001 and
    step_000002, `latest` naming the second)."""
    root = tmp_path_factory.mktemp("integrity")
    args = train_args(
        small_dataset, root / "ckpt", root / "run", "train.steps=2", "checkpoint.every=1",
        "checkpoint.keep=0",
    )  # fmt: skip
    result = invoke_cli(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "ckpt"


def flip_one_byte(path: Path) -> None:
    """Inverts one byte in the middle of a safetensors file's tensor data."""
    data = bytearray(path.read_bytes())
    data_start = 8 + int.from_bytes(data[:8], "little")
    data[(data_start + len(data)) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.fixture
def corrupt_copy(saved, tmp_path):
    """A copy of the checkpoint.dir whose newest checkpoint has one flipped byte in file `kind`."""

    def make(kind: str) -> tuple[Path, Path]:
        copy = tmp_path / "ckpt"
        shutil.copytree(saved, copy)
        damaged = copy / "step_000002" / FILES[kind]
        flip_one_byte(damaged)
        return copy, damaged

    return make


def one_line_error(*args: str) -> str:
    result = invoke_cli(*args)
    assert result.returncode == 2, result.stdout[-500:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_every_file_is_saved_with_the_checksum_of_its_bytes(saved):
    from megatronish.checkpoint.integrity import checksum_text

    step_dir = saved / "step_000002"
    files = json.loads((step_dir / "metadata.json").read_text())["files"]
    assert set(files) == set(FILES.values())
    for name, info in files.items():
        assert info["crc32c"] == checksum_text((step_dir / name).read_bytes())


@pytest.mark.parametrize("kind", list(FILES))
def test_a_flipped_byte_stops_every_loader_naming_the_file(corrupt_copy, kind, tmp_path):
    copy, damaged = corrupt_copy(kind)
    step_dir, hf, tp2 = str(damaged.parent), str(tmp_path / "hf"), str(tmp_path / "tp2")
    commands = {
        "eval": ["eval", "--checkpoint", step_dir],
        "generate": ["generate", "--checkpoint", step_dir, "--prompt", "def"],
        "export": ["export", "--checkpoint", step_dir, "--output", hf],
        "convert": ["convert", "--checkpoint", step_dir, "--tp", "2", "--output", tp2],
    }  # fmt: skip
    for name, args in commands.items():
        line = one_line_error(*args)
        assert f"{damaged}: checksum mismatch" in line, (name, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing written
    with pytest.raises(UserError, match="checksum mismatch") as raised:
        load_model(step_dir)
    assert str(damaged) in str(raised.value)


@pytest.mark.parametrize("kind", list(FILES))
def test_resume_from_a_corrupt_checkpoint_names_the_file_and_the_older_intact_one(
    corrupt_copy, kind, small_dataset, tmp_path
):
    copy, damaged = corrupt_copy(kind)
    out = tmp_path / "run"
    line = one_line_error(*train_args(small_dataset, copy, out, "train.steps=4"))
    assert f"{damaged}: checksum mismatch" in line
    assert f"--set checkpoint.resume={copy / 'step_000001'}" in line
    assert not (out / "metrics.jsonl").exists()  # nothing trained on it
    assert sorted(p.name for p in copy.glob("step_*")) == ["step_000001", "step_000002"]
    if kind == "model":  # resuming from a named checkpoint: the same line, no advice
        named = f"checkpoint.resume={damaged.parent}"
        line = one_line_error(*train_args(small_dataset, copy, out, "train.steps=4", named))
        assert f"{damaged}: checksum mismatch" in line and "checkpoint.resume=" not in line


def test_resume_says_when_no_older_checkpoint_is_intact(corrupt_copy, small_dataset, tmp_path):
    copy, damaged = corrupt_copy("model")
    flip_one_byte(copy / "step_000001" / FILES["rng"])
    line = one_line_error(*train_args(small_dataset, copy, tmp_path / "run", "train.steps=4"))
    assert f"{damaged}: checksum mismatch" in line
    assert "no older checkpoint is intact" in line and "checkpoint.resume=never" in line


def test_a_checkpoint_saved_without_checksums_loads_with_one_note(saved, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(saved / "step_000002", old)
    meta = json.loads((old / "metadata.json").read_text())
    for info in meta["files"].values():
        del info["crc32c"]
    (old / "metadata.json").write_text(json.dumps(meta))
    load_model(old)
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "cannot be verified" in note[0] and str(old) in note[0]
    result = invoke_cli("eval", "--checkpoint", str(old))
    assert result.returncode == 0, result.stderr


def test_a_recorded_checksum_that_is_not_8_hex_digits_is_named(saved, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(saved / "step_000002", bad)
    meta = json.loads((bad / "metadata.json").read_text())
    meta["files"][FILES["model"]]["crc32c"] = "xyz"
    (bad / "metadata.json").write_text(json.dumps(meta))
    line = one_line_error("eval", "--checkpoint", str(bad))
    assert str(bad / "metadata.json") in line and "crc32c must be 8 hex digits" in line
