"""Every output path is checked before any work starts: a key or flag whose path is a file, or
lies under a file, is exit status 2 with one line naming the key or flag and the path, no
traceback, and nothing created. A config error that train finds only at start (a resume or
init path, a split too short for train.seq_len) leaves the run directory as it was too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import save_single, tiny_cfg
from tests.conftest import CONFIGS, invoke_cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    step_dir, _ = save_single(tmp_path_factory.mktemp("paths") / "ckpt", tiny_cfg())
    return step_dir


def blocked_paths(tmp_path: Path) -> dict[str, Path]:
    """A file, and a path under it."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    return {"is a file": blocker, "lies under a file": blocker / "sub" / "out"}


def assert_refused(args: list[str], name: str, path: Path, tmp_path: Path) -> None:
    before = sorted(tmp_path.rglob("*"))
    result = invoke_cli(*args)
    assert result.returncode == 2, result.stdout[-500:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert f"{name} {path}:" in lines[0]
    assert sorted(tmp_path.rglob("*")) == before  # nothing created


TRAIN_SETS = [
    "model.n_layer=2", "model.n_head=4", "model.d_model=32", "model.max_seq_len=64",
    "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=1",
]  # fmt: skip


@pytest.mark.parametrize("key", ["run.out_dir", "checkpoint.dir"])
@pytest.mark.parametrize("command", ["train", "check", "launch"])
def test_a_config_key_whose_directory_is_a_file(key, command, tmp_path, small_dataset):
    for path in blocked_paths(tmp_path).values():
        sets = TRAIN_SETS + [f"data.path={small_dataset}", f"{key}={path}"]
        if key == "checkpoint.dir":
            sets.append(f"run.out_dir={tmp_path / 'run'}")
        args = [command, "--config", str(CONFIGS / "tiny.yaml")]
        assert_refused(args + [a for s in sets for a in ("--set", s)], key, path, tmp_path)


def test_the_default_checkpoint_dir_under_run_out_dir(tmp_path, small_dataset):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("in the way\n")
    sets = TRAIN_SETS + [f"data.path={small_dataset}", f"run.out_dir={out}"]
    args = ["train", "--config", str(CONFIGS / "tiny.yaml")]
    args += [a for s in sets for a in ("--set", s)]
    assert_refused(args, "checkpoint.dir (default)", out / "checkpoints", tmp_path)


@pytest.mark.parametrize("command", ["export", "convert", "import", "prepare"])
def test_an_output_directory_flag_whose_path_is_blocked_by_a_file(command, checkpoint, tmp_path):
    ckpt = str(checkpoint)
    for path in blocked_paths(tmp_path).values():
        args = {
            "export": ["export", "--checkpoint", ckpt, "--output", str(path)],
            "convert": ["convert", "--checkpoint", ckpt, "--tp", "2", "--output", str(path)],
            "import": ["import", "--hf", str(tmp_path / "no-hf-dir"), "--output", str(path)],
            "prepare": ["prepare", "--output", str(path)],
        }[command]
        assert_refused(args, "--output", path, tmp_path)


@pytest.mark.parametrize("command", ["plot", "trace"])
def test_an_output_file_flag_under_a_file(command, tmp_path):
    path = blocked_paths(tmp_path)["lies under a file"].with_suffix(".out")
    assert_refused([command, str(tmp_path), "--output", str(path)], "--output", path, tmp_path)


@pytest.mark.parametrize("command", ["plot", "trace"])
def test_an_output_file_that_is_a_directory(command, tmp_path):
    (tmp_path / "a_dir").mkdir()
    assert_refused([command, str(tmp_path), "--output", str(tmp_path / "a_dir")], "--output",
                   tmp_path / "a_dir", tmp_path)  # fmt: skip


START_ERRORS = {
    "resume": (["checkpoint.resume={tmp}/nowhere"], "nowhere: checkpoint does not exist"),
    "init_from_hf": (
        ["checkpoint.init_from_hf={tmp}/nowhere"],
        "nowhere: not a Hugging Face model directory",
    ),
    "val-split-too-short": (
        ["model.max_seq_len=4096", "train.seq_len=4096", "train.eval_every=1"],
        "the val split has only",
    ),
}


@pytest.mark.parametrize("case", sorted(START_ERRORS))
def test_a_config_error_found_at_train_start_creates_nothing_in_the_run_dir(
    case, tmp_path, dataset
):
    extra, message = START_ERRORS[case]
    out = tmp_path / "run"
    sets = [*TRAIN_SETS, f"data.path={dataset}", f"run.out_dir={out}"]
    sets += [item.format(tmp=tmp_path) for item in extra]
    args = ["train", "--config", str(CONFIGS / "tiny.yaml")]
    result = invoke_cli(*args, *[a for item in sets for a in ("--set", item)])
    assert result.returncode == 2, result.stdout[-500:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))
