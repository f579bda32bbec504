"""Files others can read: what the project writes takes its mode from the user's umask, as a
file made with `open()` does, also where a library would leave it private (safetensors and
tempfile write 0600 and make directories 0700)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from megatronish.data import prepare_dataset
from megatronish.files import umask
from megatronish.hf.exporter import export_hf
from megatronish.observe import flight
from tests.checkpoints import save_single, tiny_cfg

UMASK = 0o027  # not the usual 022, so a mode that merely happens to be 0644 does not pass


@pytest.fixture
def set_umask():
    previous = os.umask(UMASK)
    yield
    os.umask(previous)


def modes(*paths: Path) -> dict[str, int]:
    """{path: permission bits} of paths and, for a directory, everything under it."""
    found = {}
    for path in paths:
        for item in [path, *(path.rglob("*") if path.is_dir() else [])]:
            found[str(item)] = stat.S_IMODE(item.stat().st_mode)
    return found


def expected(found: dict[str, int]) -> dict[str, int]:
    return {p: (0o777 if Path(p).is_dir() else 0o666) & ~UMASK for p in found}


def test_umask_is_read_without_changing_it(set_umask):
    assert umask() == UMASK and umask() == UMASK


def test_a_checkpoint_its_hf_export_a_hang_report_and_a_dataset_follow_the_umask(
    tmp_path, set_umask
):
    step_dir, _ = save_single(tmp_path / "ckpt", tiny_cfg("gpt2"))
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    report = flight.dump(tmp_path / "run", 0, "a test")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("def f(x):\n    return x\n" * 20)
    dataset = prepare_dataset([str(tmp_path / "texts")], str(tmp_path / "data"))
    found = modes(step_dir, tmp_path / "hf", report, dataset)
    assert str(tmp_path / "hf" / "model.safetensors") in found
    assert found == expected(found)
