"""A checkpoint save that the system refuses to write: past the file-size limit (EFBIG), on a
full filesystem (ENOSPC), into a checkpoint.dir made read-only in the middle of the run (EACCES
on the rename). Each stops the run with exit status 1 and one line naming the file and the
cause (with the bytes needed and free where space is the cause), on every rank, printed once;
the save's temporary directory is removed and the previous checkpoint stays the newest. A run
that starts with less free space in checkpoint.dir than its last checkpoint takes says so in
one warning line.

The faults are real ones: a file-size limit (RLIMIT_FSIZE) on the training process, a small
tmpfs (where this process may mount one), and a directory made read-only for a training process
without the capability that lets root write anywhere (CAP_DAC_OVERRIDE).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatronish.checkpoint.format import complete_steps, find_latest
from megatronish.checkpoint.reader import Checkpoint
from megatronish.errors import RunFailure
from megatronish.files import size_text, write_failures
from megatronish.training.checkpoints import warn_if_short_of_space
from tests.checkpoints import save_single, tiny_cfg
from tests.conftest import REPO, invoke_cli
from tests.disk import file_size_limit, mounted_tmpfs
from tests.forked import fork_run
from tests.training.test_faults import (
    MEGATRONISH,
    TIMEOUT,
    config_args,
    environment,
    faulty,
    metrics_lines,
    started,
)

pytestmark = [
    pytest.mark.slow,  # training runs whose saves hit a full disk
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux faults"),
]

BASE = ("parallel.tp=1", "checkpoint.every=2", "checkpoint.keep=0")
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def messages(stderr: str) -> list[str]:
    """The lines of a run's stderr, less its progress bar."""
    lines = (line.strip() for line in re.split(r"[\r\n]", stderr))
    return [line for line in lines if line and not line.startswith("train:")]


def tmp_dirs(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".tmp-" in p.name]


def run_train(out: Path, dataset: Path, *sets: str, preexec_fn=None, **env: str):
    """`megatronish train` on the test config in a forked process (tests/forked.py: its own
    session, killed at the timeout), `preexec_fn` run in it before it starts."""
    command = [*MEGATRONISH, "train", *config_args(out, dataset, *BASE, *sets)]
    return fork_run(
        command, TIMEOUT, env=environment(**env), preexec_fn=preexec_fn, start_new_session=True
    )


def train_here(out: Path, dataset: Path, *sets: str):
    """`megatronish train` on the test config in this process (invoke_cli): for runs whose
    fault needs nothing of the process."""
    return invoke_cli("train", *config_args(out, dataset, *BASE, *sets))


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory, small_dataset) -> Path:
    """The run directory of a run that trained 2 steps and saved them (tp = 1)."""
    out = tmp_path_factory.mktemp("disk-full") / "run"
    result = train_here(out, small_dataset, "train.steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def copy_of(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


@pytest.mark.parametrize(
    "code, space",
    [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EFBIG, True), (errno.EACCES, False),
     (errno.EPERM, False), (errno.EROFS, False)],
)  # fmt: skip
def test_a_refused_write_is_one_line_naming_the_file_and_the_cause(tmp_path, code, space):
    path = tmp_path / "model_tp00.safetensors"
    with pytest.raises(RunFailure) as failed, write_failures(path, 41_234_567):
        raise OSError(code, os.strerror(code))
    message = str(failed.value)
    cause = os.strerror(code)
    assert message.startswith(f"cannot write {path}: {cause[0].lower()}{cause[1:]}")
    assert "\n" not in message and failed.value.exit_status == 1
    assert ("(needed 41.2 MB, " in message and " free on /" in message) == space, message


def test_a_rename_refused_names_both_paths(tmp_path):
    source, target = tmp_path / "step_000004.tmp-7", tmp_path / "step_000004"
    source.mkdir()
    with pytest.raises(RunFailure) as failed, write_failures(source):
        raise PermissionError(errno.EACCES, "Permission denied", str(source), None, str(target))
    assert str(failed.value) == f"cannot rename {source} to {target}: permission denied"


def test_a_save_past_the_file_size_limit_stops_the_run_in_one_line_and_keeps_the_last_checkpoint(
    saved_at_2, tmp_path, small_dataset
):
    out = copy_of(saved_at_2, tmp_path / "run")
    checkpoints = out / "checkpoints"
    shard = checkpoints / "step_000002" / "model_tp00.safetensors"
    limit = 50_000  # under the model shard (106 kB), over anything else the run writes
    assert shard.stat().st_size > limit
    limited = file_size_limit(limit)
    result = run_train(out, small_dataset, "train.steps=8", preexec_fn=limited)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = [m for m in messages(result.stderr) if m.startswith("error:")]
    needed = size_text(shard.stat().st_size)
    assert re.fullmatch(
        rf"error: cannot write {checkpoints}/step_000004\.tmp-\d+/model_tp00\.safetensors: file "
        rf"too large \(needed {needed}, \S+ \S+ free on /\S*, the file-size limit \(ulimit -f\) "
        r"is 50\.0 kB\)",
        line,
    ), line
    assert max(x["step"] for x in metrics_lines(out)) == 4, "nothing trained past the save"
    assert not tmp_dirs(checkpoints)
    assert (
        find_latest(checkpoints) == checkpoints / "step_000002" == complete_steps(checkpoints)[-1]
    )
    Checkpoint(checkpoints).verify()  # intact: the next run resumes from it


def test_an_async_save_failing_on_one_rank_stops_every_rank_with_its_line_printed_once(
    tmp_path, small_dataset
):
    out, logs = tmp_path / "run", tmp_path / "logs"
    sets = ("parallel.tp=2", "train.steps=8", "checkpoint.every=2", "checkpoint.async=true")
    command = faulty(
        out, small_dataset, *sets, torchrun=("--log-dir", str(logs), "--redirects", "3")
    )
    with started(command, out, FAULT_RANK="1", FAULT_FSIZE="30000") as run:
        status = run.finish()
        console = run.stdout + run.stderr
    assert status == 1, console[-3000:]
    rank_logs = [next(logs.glob(f"**/attempt_0/{rank}/stderr.log")).read_text() for rank in (0, 1)]
    assert sum(text.count("cannot write") for text in [console, *rank_logs]) == 1
    assert "Traceback" not in rank_logs[0] and "Traceback" not in rank_logs[1]
    assert messages(rank_logs[1]) == [], "rank 1 failed; rank 0 says so"
    assert messages(rank_logs[0])[-1].startswith(
        f"error: cannot write {out}/checkpoints/step_000002.tmp-"
    )
    assert "/model_tp01.safetensors: file too large (needed " in messages(rank_logs[0])[-1]
    assert max(x["step"] for x in metrics_lines(out)) <= 4, "stopped by the next save at latest"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["lock"]


def without_dac_override() -> None:
    """A preexec_fn: the child (still root) lacks the capabilities that let root write into a
    directory whose mode does not allow it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def read_only_stops_writes(directory: Path) -> bool:
    """Whether a child started with without_dac_override cannot create a file in a 0o555
    directory (as any non-root user cannot)."""
    directory.mkdir(0o555)
    probe = [sys.executable, "-c", f"open({str(directory / 'probe')!r}, 'w')"]
    try:
        result = subprocess.run(probe, preexec_fn=without_dac_override, capture_output=True)
    except subprocess.SubprocessError:  # the capability could not be dropped
        return False
    finally:
        directory.chmod(0o755)
    return result.returncode != 0


def test_a_checkpoint_dir_made_read_only_mid_run_stops_the_run_in_one_line(
    saved_at_2, tmp_path, small_dataset
):
    if not read_only_stops_writes(tmp_path / "probe"):
        pytest.skip("cannot start a process that a read-only directory stops")
    out, marker = copy_of(saved_at_2, tmp_path / "run"), tmp_path / "held"
    checkpoints = out / "checkpoints"
    sets = ("train.steps=8", "checkpoint.async=true")
    script = str(REPO / "tests" / "faulty_rank.py")
    command = [sys.executable, script, "train", *config_args(out, small_dataset, *BASE, *sets)]
    hold = dict(FAULT_RANK="0", FAULT_HOLD_WRITE_STEP="4", FAULT_HOLD_WRITE_S="2")
    env = environment(FAULT_HOLD_MARKER=str(marker), **hold)
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=err, env=env,
            preexec_fn=without_dac_override, start_new_session=True,
        )  # fmt: skip
        try:
            while not marker.exists():  # until step 4's save is being written (held there)
                assert proc.poll() is None, "ended before its save of step 4 was held"
                time.sleep(0.02)
            checkpoints.chmod(0o555)
            proc.wait(timeout=TIMEOUT)
        finally:
            checkpoints.chmod(0o755)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        err.seek(0)
        stderr = err.read()
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [m for m in messages(stderr) if m.startswith("error:")] == [
        f"error: cannot rename {checkpoints}/step_000004.tmp-{proc.pid} to "
        f"{checkpoints}/step_000004: permission denied"
    ]
    # A read-only directory keeps its entries: the save's is left, emptied, for the next to clear.
    assert tmp_dirs(checkpoints) == [f"step_000004.tmp-{proc.pid}"]
    assert not any((checkpoints / f"step_000004.tmp-{proc.pid}").iterdir())
    assert (
        find_latest(checkpoints) == checkpoints / "step_000002" == complete_steps(checkpoints)[-1]
    )


@pytest.fixture
def small_filesystem(tmp_path, saved_at_2):
    """A tmpfs with room for one and a half of saved_at_2's checkpoints, mounted for the test
    (skips where this process may not mount one), unmounted after it."""
    size = sum(p.stat().st_size for p in (saved_at_2 / "checkpoints" / "step_000002").iterdir())
    mount = tmp_path / "small"
    mount.mkdir()
    with mounted_tmpfs(mount, size * 3 // 2) as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here")
        yield mount


def test_a_save_on_a_full_filesystem_stops_the_run_in_one_line_after_a_warning_at_start(
    saved_at_2, tmp_path, small_dataset, small_filesystem
):
    out = copy_of(saved_at_2, tmp_path / "run")
    checkpoints = small_filesystem / "checkpoints"
    shutil.copytree(out / "checkpoints", checkpoints)
    result = train_here(out, small_dataset, "train.steps=8", f"checkpoint.dir={checkpoints}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    warning, error = messages(result.stderr)
    size = size_text(sum(p.stat().st_size for p in (checkpoints / "step_000002").iterdir()))
    assert re.fullmatch(
        rf"warning: checkpoint\.dir {checkpoints} has \S+ \S+ free, less than the last "
        rf"checkpoint's {size} \(step_000002\): the next save will fail; free space on "
        rf"{small_filesystem} or set checkpoint\.dir to another disk",
        warning,
    ), warning
    assert re.fullmatch(
        rf"error: cannot write {checkpoints}/step_000004\.tmp-\d+/\w+\.safetensors: no space left "
        rf"on device \(needed \S+ \S+, \S+ \S+ free on {small_filesystem}\)",
        error,
    ), error
    assert not tmp_dirs(checkpoints)
    assert (
        find_latest(checkpoints) == checkpoints / "step_000002" == complete_steps(checkpoints)[-1]
    )


def test_the_warning_at_start_compares_the_free_space_with_the_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    step_dir, _ = save_single(tmp_path / "checkpoints", tiny_cfg())
    needed = sum(p.stat().st_size for p in step_dir.iterdir())
    usage = shutil.disk_usage(tmp_path)
    for free in (needed, needed - 1):
        monkeypatch.setattr(shutil, "disk_usage", lambda _, free=free: usage._replace(free=free))
        warn_if_short_of_space(tmp_path / "checkpoints", step_dir)
    warn_if_short_of_space(tmp_path / "checkpoints", None)  # a fresh run: nothing to compare
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(
        f"warning: checkpoint.dir {tmp_path / 'checkpoints'} has {size_text(needed - 1)} free, "
        f"less than the last checkpoint's {size_text(needed)} (step_000002): the next save will "
        "fail; free space on /"
    ), line
