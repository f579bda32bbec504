"""checkpoint.async: a save copies the state and returns; the files are written in the
background and the checkpoint becomes one that resume takes only once every rank's files are on
disk. A rank killed mid-write resumes from the previous complete save with the losses of an
uninterrupted run; a SIGTERM with a save in flight exits 0 once it is complete; a process that
cannot start a writer thread exits 2 in one line.

The end-to-end tests hold a rank's writer mid-save (tests/faulty_rank.py, FAULT_HOLD_WRITE_*)
so that the kill or signal lands while a write is in flight, every time.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatronish.checkpoint import async_save
from megatronish.checkpoint.format import complete_steps, find_latest
from megatronish.checkpoint.save import save_checkpoint
from megatronish.distributed.layout import ParallelState
from tests.checkpoints import BYTES, tiny_cfg, trained
from tests.conftest import CONFIGS, invoke_cli
from tests.ranks import run_cli_on_ranks
from tests.training.test_faults import (
    SMALL,
    TIMEOUT,
    TORCHRUN,
    config_args,
    faulty,
    metrics_lines,
    resumed_steps,
    started,
    training_curve,
)

pytestmark = [
    pytest.mark.slow,  # torchrun runs with background saves held and stopped
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

STEPS = 8


def save_args(model, optimizer, derived) -> dict:
    return dict(
        cfg=model.cfg, derived=derived, ps=model.ps, model=model, optimizer=optimizer,
        tokenizer=BYTES,
    )  # fmt: skip


def shard_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        out.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    return out


def test_an_async_save_holds_the_state_of_its_step_and_is_complete_only_once_completed(tmp_path):
    model, optimizer, derived = trained(tiny_cfg(), ParallelState.single())
    args = save_args(model, optimizer, derived)
    sync_dir = save_checkpoint(tmp_path / "sync", 2, **args)
    saver = async_save.AsyncSaver()
    try:
        saver.begin(tmp_path / "async", 2, **args)
        with torch.no_grad():  # training goes on: the save keeps the state it copied
            for param in model.parameters():
                param.add_(1.0)
        saver.pending.done.wait(timeout=TIMEOUT)
        assert find_latest(tmp_path / "async") is None, "written but not yet complete"
        assert [p.name.split(".tmp-")[0] for p in (tmp_path / "async").iterdir()] == ["step_000002"]
        async_dir = saver.complete()
    finally:
        saver.close()
    assert find_latest(tmp_path / "async") == async_dir == tmp_path / "async" / "step_000002"
    expected, got = shard_tensors(sync_dir), shard_tensors(async_dir)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_closing_an_async_saver_waits_for_its_writer_thread_to_end(tmp_path, monkeypatch):
    # A writer left running as the interpreter exits is ended inside a torch call: SIGABRT.
    writing = threading.Event()

    def slow_write(path, tensors):
        writing.set()
        time.sleep(0.2)  # still writing when close() is called
        return "00000000"

    monkeypatch.setattr(async_save, "write_file", slow_write)
    saver = async_save.AsyncSaver()
    job = async_save.WriteJob(tmp_path, {"model.safetensors": {"w": torch.zeros(1)}}, None, {})
    saver.thread.jobs.put(job)
    assert writing.wait(timeout=TIMEOUT)
    saver.close()
    assert job.done.is_set() and not saver.thread.is_alive()


def test_an_async_save_whose_copy_fails_is_reported_at_completion_and_never_taken(
    tmp_path, monkeypatch
):
    model, optimizer, derived = trained(tiny_cfg(), ParallelState.single())
    saver = async_save.AsyncSaver()

    def no_memory(*args):
        raise RuntimeError("out of host memory for the copy")

    monkeypatch.setattr(saver, "copy", no_memory)
    try:
        saver.begin(tmp_path / "async", 2, **save_args(model, optimizer, derived))
        assert not saver.writing  # nothing queued: the step's flags agree it is done
        with pytest.raises(RuntimeError, match="out of host memory"):
            saver.complete()
    finally:
        saver.close()
    assert find_latest(tmp_path / "async") is None


def test_checkpoint_async_where_no_writer_thread_can_start_exits_2_in_one_line(
    tmp_path, monkeypatch, small_dataset
):
    def cannot_start(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(async_save.WriterThread, "start", cannot_start)
    sets = [*SMALL, "parallel.tp=1", f"data.path={small_dataset}", f"run.out_dir={tmp_path}",
            "train.steps=2", "checkpoint.async=true"]  # fmt: skip
    args = [
        "train",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        *[x for s in sets for x in ("--set", s)],
    ]
    result = invoke_cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.async: "), lines
    assert "can't start new thread" in lines[0] and "checkpoint.async=false" in lines[0]
    assert not (tmp_path / "checkpoints").exists() or not complete_steps(tmp_path / "checkpoints")


def wait_for(path: Path, run) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert run.proc.poll() is None, f"ended before {path.name}:\n{run.stderr[-3000:]}"
        assert time.monotonic() < deadline, f"no {path.name} within {TIMEOUT} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def killed_mid_write(tmp_path_factory, small_dataset) -> dict:
    """dp = 2 with ZeRO-1 (the save gathers optimizer state) under torchrun --max-restarts 1,
    checkpoint.async, a save every 2 steps: rank 1's
    writer holds in the middle of step 4's save and rank 1 gets SIGKILL there; torchrun restarts
    both ranks, which train to STEPS. Before it, the same run uninterrupted and saving
    synchronously, on two fork-served ranks (tests/ranks.py)."""
    root = tmp_path_factory.mktemp("async")
    reference, out, marker = root / "reference", root / "run", root / "held"
    sets = (f"train.steps={STEPS}", "checkpoint.keep=0", "parallel.tp=1", "optim.zero=1")
    for result in run_cli_on_ranks(["train", *config_args(reference, small_dataset, *sets)], 2):
        assert result.returncode == 0, result.stderr[-3000:]
    command = faulty(
        out, small_dataset, *sets, "checkpoint.async=true", torchrun=("--max-restarts=1",)
    )
    hold = dict(FAULT_RANK="1", FAULT_HOLD_WRITE_STEP="4", FAULT_HOLD_WRITE_S="120")
    hold["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a fresh store per attempt, as launch does
    seen: dict = {}
    with started(command, out, FAULT_HOLD_MARKER=str(marker), **hold) as run:
        wait_for(marker, run)
        checkpoints = out / "checkpoints"
        seen["latest_in_flight"] = find_latest(checkpoints)
        seen["in_flight"] = sorted(p.name for p in checkpoints.glob("step_000004*"))
        os.kill(run.rank_pid(1), signal.SIGKILL)
        seen["status"] = run.finish()
        seen["stdout"], seen["stderr"] = run.stdout, run.stderr
    seen["curve"], seen["reference"] = training_curve(out), training_curve(reference)
    seen["left"] = sorted(p.name for p in (out / "checkpoints").iterdir())
    seen["lines"] = metrics_lines(out)
    return seen


def test_a_save_in_flight_is_never_the_checkpoint_resume_takes(killed_mid_write):
    seen = killed_mid_write
    assert seen["latest_in_flight"].name == "step_000002", "step 4 is still being written"
    (in_flight,) = seen["in_flight"]
    assert in_flight.startswith("step_000004.tmp-")
    assert resumed_steps(seen["stdout"]) == [2], seen["stderr"][-3000:]


def test_a_rank_killed_during_an_async_write_resumes_with_the_losses_of_an_uninterrupted_run(
    killed_mid_write,
):
    seen = killed_mid_write
    assert seen["status"] == 0, seen["stderr"][-3000:]
    assert [step for step, _ in seen["curve"]] == list(range(1, STEPS + 1)), "each step once"
    assert seen["curve"] == seen["reference"], "the same losses, bitwise, as the sync run"
    saves = [f"step_{s:06d}" for s in range(2, STEPS + 1, 2)]
    assert seen["left"] == ["latest", "lock", *saves], "no temporary directory is left"


def test_sigterm_with_an_async_save_in_flight_exits_0_after_the_save_completes(
    tmp_path, small_dataset
):
    out, marker, hold_s = tmp_path / "run", tmp_path / "held", 2.0
    sets = ("parallel.tp=1", "train.steps=100000", "checkpoint.async=true", "checkpoint.keep=0")
    command = [sys.executable, *faulty(out, small_dataset, *sets)[len(TORCHRUN) :]]
    hold = dict(FAULT_RANK="0", FAULT_HOLD_WRITE_STEP="2", FAULT_HOLD_WRITE_S=str(hold_s))
    hold["FAULT_HOLD_MARKER"] = str(marker)
    # A real interpreter: its exit status includes the native teardown after Python's (static
    # destructors, where an abort would show), which a forked process skips.
    with started(command, out, real=True, **hold) as run:
        wait_for(marker, run)
        held_at = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        status = run.finish()
        ran_on = time.monotonic() - held_at
        stdout, stderr = run.stdout, run.stderr
    assert status == 0, stderr[-3000:]
    assert ran_on >= hold_s * 0.9, "it waited for the held write"
    stopped = run.last_step()
    assert f"stopped at step {stopped} of 100000 (SIGTERM): saved step {stopped}" in stdout
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{stopped:06d}"
    lines = [line.strip() for line in stdout.splitlines()]
    saved = [line.rsplit("/", 1)[1] for line in lines if line.startswith("saved ")]
    assert saved[0] == "step_000002" and saved[-1] == f"step_{stopped:06d}"
    assert [p.name for p in complete_steps(checkpoints)] == saved
    assert not [p for p in checkpoints.iterdir() if ".tmp-" in p.name]
