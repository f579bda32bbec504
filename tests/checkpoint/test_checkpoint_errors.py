"""A missing, truncated, corrupt or mismatched checkpoint is a user error: exit status 2 and one
line that names the file and what is wrong, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from megatronish.checkpoint.convert import convert_checkpoint
from megatronish.cli import cli
from tests.checkpoints import save_single, tiny_cfg
from tests.conftest import CONFIGS, run_cli


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tp = 2 checkpoint (step directory) of a tiny gpt2."""
    root = tmp_path_factory.mktemp("good")
    step_dir, _ = save_single(root / "tp1", tiny_cfg())
    return convert_checkpoint(str(step_dir), 2, str(root / "tp2"))


@pytest.fixture
def broken(good, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(good, copy)
    return copy


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_missing_checkpoint_directory(tmp_path):
    line = one_line_error(["eval", "--checkpoint", str(tmp_path / "nowhere")])
    assert f"{tmp_path / 'nowhere'}: checkpoint does not exist" in line


def test_a_directory_without_a_checkpoint(tmp_path):
    line = one_line_error(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"])
    assert str(tmp_path) in line and "no checkpoint here" in line


def test_a_truncated_shard_file(broken):
    shard = broken / "model_tp01.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    line = one_line_error(["export", "--checkpoint", str(broken), "--output", str(broken / "x")])
    assert str(shard) in line and "truncated" in line


def test_a_shard_file_cut_to_its_recorded_size_but_corrupt(broken):
    shard = broken / "optim_tp00_dp000.safetensors"
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    line = one_line_error(
        ["convert", "--checkpoint", str(broken), "--tp", "1", "--output", str(broken / "x")]
    )
    assert str(shard) in line and "checksum mismatch" in line


def test_a_missing_shard_file(broken):
    (broken / "model_tp01.safetensors").unlink()
    line = one_line_error(["eval", "--checkpoint", str(broken)])
    assert str(broken / "model_tp01.safetensors") in line and "missing" in line


@pytest.mark.parametrize("damage", ["not json", "a wrong shape", "no tensors"])
def test_corrupt_metadata(broken, damage):
    meta_path = broken / "metadata.json"
    meta = json.loads(meta_path.read_text())
    if damage == "not json":
        meta_path.write_text(meta_path.read_text()[:-20])
    elif damage == "a wrong shape":
        meta["tensors"]["blocks.0.mlp.up.weight"]["full_shape"] = [128, 64]
        meta_path.write_text(json.dumps(meta))
    else:
        del meta["tensors"]
        meta_path.write_text(json.dumps(meta))
    line = one_line_error(["eval", "--checkpoint", str(broken)])
    if damage == "a wrong shape":  # the shard disagrees with the metadata: names the shard
        assert str(broken / "model_tp00.safetensors") in line
        assert "is [128, 64], but metadata.json says [64, 64]" in line
    else:
        assert str(meta_path) in line


def test_resuming_with_a_model_of_another_shape(good, tmp_path, small_dataset):
    def resume_line(checkpoint) -> str:
        sets = [
            "model.n_layer=2", "model.n_head=4", "model.d_model=32", "model.max_seq_len=64",
            "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"data.path={small_dataset}", f"checkpoint.resume={checkpoint}",
            f"run.out_dir={tmp_path / 'run'}",
        ]  # fmt: skip
        args = ["train", "--config", str(CONFIGS / "tiny.yaml")]
        return one_line_error(args + [x for s in sets for x in ("--set", s)])

    assert resume_line(good) == (
        f"error: model.d_model: the checkpoint in {good} was trained with 64, the config asks "
        "for 32; keep model.d_model=64, or start over with checkpoint.resume=never"
    )
    # A config.yaml that does not describe the tensors: their recorded shapes still refuse.
    copy = tmp_path / "ckpt"
    shutil.copytree(good, copy)
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace("  d_model: 64\n", "  d_model: 32\n"))
    line = resume_line(copy)
    assert str(copy / "metadata.json") in line
    assert "'tok_emb.weight' is [257, 64]" in line and "but [257, 32]" in line


def test_the_real_command_exits_2_without_a_traceback(broken):
    (broken / "metadata.json").write_text("{")
    result = run_cli("generate", "--checkpoint", str(broken), "--prompt", "hi")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{broken / 'metadata.json'}: not valid JSON" in lines[0]
