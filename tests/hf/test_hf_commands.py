"""`export` and `import` as a user meets them: on a disk too small for what they write each
exits with status 1 and one line (the file, the cause, the bytes needed and free) and leaves
nothing behind; import refuses a --set of the model that config.json decides; both commands'
help and the manual name every family of the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatronish.checkpoint.reader import Checkpoint
from megatronish.files import size_text
from megatronish.hf.exporter import export_hf
from megatronish.hf.files import WEIGHTS
from megatronish.hf.registry import FAMILIES
from tests.checkpoints import save_single, tiny_cfg
from tests.conftest import REPO, invoke_cli
from tests.disk import CAUSE

SPACE = r"\(needed {needed}, \S+ \S+ free on /\S*(, the file-size limit \(ulimit -f\) is \S+ kB)?\)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Llama's checkpoint directory, its Hugging Face export)."""
    root = tmp_path_factory.mktemp("hf-commands")
    save_single(root / "ckpt", tiny_cfg("llama"))
    export_hf(str(root / "ckpt"), str(root / "hf"))
    return root / "ckpt", root / "hf"


def one_error_line(result, status: int) -> str:
    assert result.returncode == status, result.stdout[-500:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    return line


def test_export_on_a_full_disk_exits_1_in_one_line_with_the_bytes_needed_and_leaves_nothing(
    saved, full_disk
):
    checkpoint, hf_dir = saved
    out = full_disk.root / "hf"
    line = one_error_line(
        full_disk.run("export", "--checkpoint", str(checkpoint), "--output", str(out)), 1
    )
    needed = re.escape(size_text((hf_dir / WEIGHTS).stat().st_size))
    assert re.fullmatch(
        rf"error: cannot write {full_disk.root}/\.hf\.tmp-\d+/{WEIGHTS}: {CAUSE} "
        + SPACE.format(needed=needed),
        line,
    ), line
    assert full_disk.leftovers() == []


@pytest.mark.parametrize("existed", [False, True], ids=["new", "empty-before"])
def test_import_on_a_full_disk_exits_1_in_one_line_and_leaves_only_what_was_there(
    saved, full_disk, existed
):
    checkpoint, hf_dir = saved
    out = full_disk.root / "ckpt"
    if existed:
        out.mkdir()
    line = one_error_line(full_disk.run("import", "--hf", str(hf_dir), "--output", str(out)), 1)
    shard = Checkpoint(checkpoint).dir / "model_tp00.safetensors"
    assert re.fullmatch(
        rf"error: cannot write {out}/step_000000\.tmp-\d+/model_tp00\.safetensors: {CAUSE} "
        + SPACE.format(needed=re.escape(size_text(shard.stat().st_size))),
        line,
    ), line
    assert full_disk.leftovers() == (["ckpt"] if existed else [])
    assert not existed or not any(out.iterdir())


@pytest.mark.parametrize("key", ["model.n_layer=3", "model.dropout=0.1", "model.moe.top_k=1"])
def test_import_refuses_a_model_setting_in_set_in_one_line_naming_config_json(saved, tmp_path, key):
    _, hf_dir = saved
    out = tmp_path / "ckpt"
    result = invoke_cli("import", "--hf", str(hf_dir), "--output", str(out), "--set", key)
    line = one_error_line(result, 2)
    assert line == (
        f"error: --set {key}: import takes the model from {hf_dir / 'config.json'} (every "
        "model.* key); drop it (a training run's settings, such as model.dropout, go in its "
        "own config)"
    ), line
    assert not out.exists()


def test_import_keeps_a_setting_in_set_that_is_not_the_models(saved, tmp_path):
    _, hf_dir = saved
    out = tmp_path / "ckpt"
    sets = ("--set", "train.seq_len=16", "--set", f"data.path={tmp_path / 'data'}")
    result = invoke_cli("import", "--hf", str(hf_dir), "--output", str(out), *sets)
    assert result.returncode == 0, result.stderr
    config = Checkpoint(out).config
    assert config.train.seq_len == 16 and config.data.path == str(tmp_path / "data")


def words(text: str) -> str:
    """text with every run of white space one space (help and the manual wrap lines)."""
    return " ".join(text.split())


@pytest.mark.parametrize("command", ["import", "export"])
def test_import_and_export_help_name_every_family_of_the_registry(command):
    result = invoke_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    missing = [family.name for family in FAMILIES if family.name not in words(result.stdout)]
    assert not missing, f"`{command} --help` does not name {missing}:\n{result.stdout}"


def test_the_manual_names_every_family_and_its_class():
    manual = words((REPO / "docs" / "checkpoints.md").read_text())
    names = [text for family in FAMILIES for text in (family.name, family.architecture)]
    assert [text for text in names if text not in manual] == []
