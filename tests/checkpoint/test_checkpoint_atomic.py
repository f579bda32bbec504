"""A save interrupted at any point leaves the previous complete checkpoint as the one that loads;
a save that fails removes its temporary directory; old checkpoints are deleted only once a new
one is complete."""

from __future__ import annotations

import os

import pytest
import torch

import megatronish.checkpoint.rank_files as rank_files_module
import megatronish.checkpoint.save as save_module
from megatronish import load_model
from megatronish.checkpoint.format import find_latest
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import load_config
from megatronish.distributed.layout import ParallelState
from megatronish.errors import RunFailure
from megatronish.training.resume import resume_path
from tests.checkpoints import BYTES, save_single, tiny_cfg, trained


def _save(directory, step, model, optimizer, derived, keep=0):
    return save_module.save_checkpoint(
        directory, step, cfg=model.cfg, derived=derived, ps=model.ps, model=model,
        optimizer=optimizer, tokenizer=BYTES, keep=keep,
    )  # fmt: skip


@pytest.fixture
def two_models():
    """Two different trained models of one config: what step 1 saved, and what step 2 saves."""
    cfg = tiny_cfg()
    first = trained(cfg, ParallelState.single(), steps=1)
    second = trained(cfg, ParallelState.single(), steps=2)
    return first, second


def _fail(*args, **kwargs):
    raise OSError("simulated crash")


def _tmp_dirs(directory):
    return [p for p in directory.iterdir() if ".tmp-" in p.name]


def _assert_loads_step_1(directory, first_model):
    assert Checkpoint(directory).step == 1
    loaded = load_model(directory)
    assert loaded.step == 1
    for (name, want), got in zip(first_model.named_parameters(), loaded.gpt.parameters()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize(
    "crash_in, raised",
    [("serializing shards", OSError), ("renaming the directory", RunFailure)],
)
def test_a_save_failing_before_the_rename_leaves_the_previous_checkpoint_latest(
    tmp_path, monkeypatch, two_models, crash_in, raised
):
    (model1, opt1, derived), (model2, opt2, _) = two_models
    _save(tmp_path, 1, model1, opt1, derived)
    if crash_in == "serializing shards":
        monkeypatch.setattr(rank_files_module, "serialize", _fail)
    else:
        monkeypatch.setattr(os, "rename", _fail)
    with pytest.raises(raised, match="simulated crash"):
        _save(tmp_path, 2, model2, opt2, derived)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step_000001\n"
    assert not (tmp_path / "step_000002").exists()
    assert not _tmp_dirs(tmp_path), "the failed save removed its temporary directory"
    _assert_loads_step_1(tmp_path, model1)
    # The next complete save clears what a killed save left behind.
    (tmp_path / "step_000002.tmp-99").mkdir()
    _save(tmp_path, 3, model2, opt2, derived)
    assert find_latest(tmp_path).name == "step_000003" and not _tmp_dirs(tmp_path)


def test_a_save_interrupted_before_latest_is_replaced_still_loads_the_previous_one(
    tmp_path, monkeypatch, two_models
):
    (model1, opt1, derived), (model2, opt2, _) = two_models
    _save(tmp_path, 1, model1, opt1, derived)
    monkeypatch.setattr(os, "replace", _fail)
    with pytest.raises(RunFailure, match="simulated crash"):
        _save(tmp_path, 2, model2, opt2, derived)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step_000001\n"
    _assert_loads_step_1(tmp_path, model1)


def test_keep_deletes_older_checkpoints_only_after_the_new_one_is_complete(tmp_path, two_models):
    (model, optimizer, derived), _ = two_models
    for step in (1, 2, 3):
        _save(tmp_path, step, model, optimizer, derived, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_a_latest_naming_a_missing_directory_falls_back_to_the_newest_complete_one(tmp_path):
    save_single(tmp_path, tiny_cfg(), step=4)
    (tmp_path / "latest").write_text("step_000009\n")
    (tmp_path / "step_000010.tmp-99").mkdir()  # an interrupted save is never a candidate
    assert Checkpoint(tmp_path).step == 4


def test_resume_auto_ignores_interrupted_saves_and_starts_fresh_without_a_checkpoint(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}"])
    assert resume_path(cfg) is None
    (tmp_path / "checkpoints" / "step_000005.tmp-123").mkdir(parents=True)
    assert resume_path(cfg) is None
    save_single(tmp_path / "checkpoints", tiny_cfg(), step=2)
    assert resume_path(cfg) == tmp_path / "checkpoints" / "step_000002"
    never = load_config(None, [f"run.out_dir={tmp_path}", "checkpoint.resume=never"])
    assert resume_path(never) is None


def test_a_resave_of_a_step_whose_rename_fails_puts_the_earlier_save_of_that_step_back(
    tmp_path, monkeypatch, two_models
):
    (model1, opt1, derived), (model2, opt2, _) = two_models
    _save(tmp_path, 1, model1, opt1, derived)
    rename = os.rename

    def refuse_the_temporary_directory(source, target):
        if ".tmp-" in str(source):
            raise PermissionError(13, "Permission denied", str(source), None, str(target))
        rename(source, target)

    monkeypatch.setattr(os, "rename", refuse_the_temporary_directory)
    with pytest.raises(RunFailure, match=r"cannot rename .*\.tmp-\d+ to .*step_000001: permission"):
        _save(tmp_path, 1, model2, opt2, derived)  # a run resumed from before step 1 saves it again
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    _assert_loads_step_1(tmp_path, model1)


def test_a_resave_whose_latest_cannot_be_written_leaves_one_copy_of_the_step(
    tmp_path, monkeypatch, two_models
):
    (model1, opt1, derived), (model2, opt2, _) = two_models
    _save(tmp_path, 1, model1, opt1, derived)
    (tmp_path / "step_000000.old-7").mkdir()  # what an earlier interrupted re-save left
    write = save_module.write_text_atomic

    def full_disk(path, text):
        if path.name == "latest":
            raise OSError(28, "No space left on device", str(path))
        write(path, text)

    monkeypatch.setattr(save_module, "write_text_atomic", full_disk)
    with pytest.raises(RunFailure, match=r"cannot write .*latest: no space left on device"):
        _save(tmp_path, 1, model2, opt2, derived)  # the earlier copy is gone before `latest`
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_000000.old-7",
        "step_000001",
    ]
    _save(tmp_path, 2, model2, opt2, derived)  # a save that completes clears what others left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000002"]
