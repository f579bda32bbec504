"""Faults, end to end on CPU gloo: ranks die with their launcher; a second run on a locked
checkpoint.dir is refused in one line; a worker killed under --max-restarts, SIGTERM to the
launcher and SIGUSR1 to one rank all end in the loss curve of an uninterrupted run; non-finite
steps are skipped alike on every rank, counted, never saved, and stop the run after
train.max_skipped_steps in a row; a rank that raises brings every rank down with its message
printed once.

Every command runs in a session of its own and is killed, with any process still naming its
run directory, in a finally block whatever the test does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatronish.checkpoint.lock import RunLock, run_lock
from megatronish.config import load_config
from megatronish.distributed.layout import ParallelState
from megatronish.distributed.processes import child_pids, process_alive
from megatronish.errors import RunFailure, UserError
from megatronish.training.setup import setup
from megatronish.training.trainer import Trainer
from tests.conftest import CONFIGS, REPO, invoke_cli
from tests.forked import fork_popen, fork_run
from tests.ranks import free_port
from tests.tolerances import EXACT

pytestmark = [
    pytest.mark.slow,  # torchrun runs with ranks killed, stalled and stopped
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

TIMEOUT = 180  # seconds any one command may take before the test fails
STEPS = 40  # the uninterrupted curve: longer than the interrupted run gets
# A model small enough that startup dominates: a run of STEPS steps takes a few seconds.
SMALL = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.max_seq_len=32",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=1000",  # > any run's steps: a step's lr does not depend on train.steps
    "train.log_every=1",
    "train.eval_every=0",
    "parallel.tp=2",
    "checkpoint.every=2",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
MEGATRONISH = [sys.executable, "-m", "megatronish"]


def config_args(out_dir: Path, dataset: Path, *overrides: str) -> list[str]:
    sets = [*SMALL, f"data.path={dataset}", f"run.out_dir={out_dir}", *overrides]
    return ["--config", str(CONFIGS / "tiny.yaml"), *[a for s in sets for a in ("--set", s)]]


def environment(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def processes_naming(marker: str) -> list[int]:
    """Live processes whose command line contains marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and process_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def metrics_lines(out_dir: Path) -> list[dict]:
    """The complete lines of metrics.jsonl so far."""
    path = out_dir / "metrics.jsonl"
    lines = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            lines.append(json.loads(line))
    return lines


class Run:
    """One command in its own session, its output in files beside its run directory: forked
    from the fork server (tests/forked.py) unless real, a subprocess. With ranks, the command
    on that many ranks as torchrun starts them (forked_ranks); proc is rank 0's, its output
    the run's."""

    def __init__(
        self,
        command: list[str],
        out_dir: Path,
        name: str,
        env: dict[str, str],
        real: bool,
        ranks: int = 0,
    ):
        self.out_dir, self.marker = out_dir, f"run.out_dir={out_dir}"
        self.stdout_path = out_dir.parent / f"{name}.stdout"
        self.stderr_path = out_dir.parent / f"{name}.stderr"
        files = dict(stdout=self.stdout_path, stderr=self.stderr_path)
        self.others: list = []  # the ranks after rank 0, with ranks
        if ranks:
            self.proc, *self.others = forked_ranks(command, ranks, env, out_dir.parent / name)
            return
        if not real:
            self.proc = fork_popen(command, env=env, cwd=REPO, start_new_session=True, **files)
            return
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True
            )

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def last_step(self) -> int:
        return max((x["step"] for x in metrics_lines(self.out_dir)), default=0)

    def wait_for_step(self, step: int) -> int:
        """Waits until metrics.jsonl reaches step (or later); returns the step it reached."""
        deadline = time.monotonic() + TIMEOUT
        while (reached := self.last_step()) < step:
            assert self.proc.poll() is None, f"ended before step {step}:\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no step {step} within {TIMEOUT} s"
            time.sleep(0.02)
        return reached

    def rank_pid(self, rank: int) -> int:
        """The pid of the rank `rank` this command (torchrun or launch) started."""
        for pid in child_pids(self.proc.pid):
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in environ:
                    return pid
        raise AssertionError(f"no rank {rank} among the children of {self.proc.pid}")

    def finish(self) -> int:
        return self.proc.wait(timeout=TIMEOUT)

    def kill(self) -> None:
        for proc in (self.proc, *self.others):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in processes_naming(self.marker):  # ranks that outlived it (a failed test)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def forked_ranks(command: list[str], world_size: int, env: dict[str, str], files: Path) -> list:
    """command (a Python program) on world_size ranks as torchrun starts them (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each forked from the fork server in a session of its
    own with env, writing to files.stdout and files.stderr (rank 0) or files.rank1.stdout ...:
    for runs whose property is the ranks', not torchrun's or a fresh interpreter's."""
    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GROUP_RANK="0")
    rendezvous.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    ranks = []
    for rank in range(world_size):
        prefix = f"{files}.rank{rank}" if rank else str(files)
        outputs = dict(stdout=f"{prefix}.stdout", stderr=f"{prefix}.stderr")
        rank_env = dict(env, **rendezvous, RANK=str(rank), LOCAL_RANK=str(rank))
        ranks.append(fork_popen(command, env=rank_env, cwd=REPO, start_new_session=True, **outputs))
    return ranks


@contextlib.contextmanager
def started(
    command: list[str],
    out_dir: Path,
    name: str | None = None,
    real: bool = False,
    ranks: int = 0,
    **env: str,
):
    """command's Run (forked unless real; on forked ranks with ranks), killed with whatever it
    started on leaving."""
    run = Run(command, out_dir, name or out_dir.name, environment(**env), real, ranks)
    try:
        yield run
    finally:
        run.kill()


def launch(out_dir: Path, dataset: Path, *overrides: str, options: tuple[str, ...] = ()):
    return [*MEGATRONISH, "launch", *options, *config_args(out_dir, dataset, *overrides)]


def training_curve(out_dir: Path) -> list[tuple[int, float]]:
    return [(x["step"], x["loss"]) for x in metrics_lines(out_dir) if "loss" in x]


def resumed_steps(stdout: str) -> list[int]:
    return [int(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if "resumed from" in line]


# --------------------------------------------------------------------------------------------
# Parent death and the lock, without training

GRANDPARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
RANK_LIKE = """
import sys, time
from megatronish.distributed.processes import die_with_parent
die_with_parent(poll_s=0.2, use_prctl={use_prctl})
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("use_prctl", [True, False], ids=["prctl", "watchdog"])
def test_a_process_dies_within_seconds_of_its_parent_being_killed(use_prctl):
    code = RANK_LIKE.format(use_prctl=use_prctl)
    parent = subprocess.Popen(
        [sys.executable, "-c", GRANDPARENT, code], stdout=subprocess.PIPE, text=True,
        env=environment(), start_new_session=True,
    )  # fmt: skip
    child = None
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 5
        while process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(child), "the child outlived its parent by 5 s"
    finally:
        for pid in (parent.pid, child):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=30)


HOLDER = """
import sys, time
from megatronish.checkpoint.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_the_lock_names_its_holder_and_is_taken_over_once_the_holder_is_killed(tmp_path):
    directory, said = tmp_path / "checkpoints", tmp_path / "holder.stdout"
    holder = fork_popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdout=said, env=environment(),
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while not said.read_text():
            assert holder.poll() is None and time.monotonic() < deadline, "never locked"
            time.sleep(0.02)
        assert said.read_text().strip() == "locked"
        with pytest.raises(UserError) as refused:
            RunLock(directory).acquire()
        assert str(directory) in str(refused.value) and f"pid {holder.pid} " in str(refused.value)
        with pytest.raises(UserError) as in_a_run, run_lock(directory, ParallelState.single()):
            pass
        assert in_a_run.value.rank0_prints, "raised on every rank; rank 0 prints it"
        holder.kill()
        holder.wait(timeout=30)
        assert f"pid {holder.pid} " in (directory / "lock").read_text(), "a stale lock file"
        lock = RunLock(directory)
        lock.acquire()
        assert (directory / "lock").read_text().startswith(f"pid {os.getpid()} ")
        lock.release()
    finally:
        holder.kill()
        holder.wait(timeout=30)


# --------------------------------------------------------------------------------------------
# A launch of two nodes with one started


def launch_one_of_two_nodes(out_dir: Path, dataset: Path, *options: str) -> list[str]:
    endpoint = f"127.0.0.1:{free_port()}"
    options = ("--nnodes", "2", "--rdzv-endpoint", endpoint, *options)
    return launch(out_dir, dataset, "parallel.tp=1", "parallel.dp=2", options=options)


def wait_for_text(run: Run, text: str, limit_s: float = 60.0) -> str:
    """run's stderr once it contains text (a failure if the run ends or limit_s passes first)."""
    deadline = time.monotonic() + limit_s
    while text not in run.stderr:
        assert run.proc.poll() is None, f"ended without {text!r}:\n{run.stderr[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {limit_s} s"
        time.sleep(0.05)
    return run.stderr


def wait_for_file(run: Run, path: Path) -> None:
    """Waits until path exists (a failure if the run ends or TIMEOUT passes first)."""
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert run.proc.poll() is None, f"ended without {path.name}:\n{run.stderr[-3000:]}"
        assert time.monotonic() < deadline, f"no {path.name} within {TIMEOUT} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def one_of_two_nodes(tmp_path_factory, small_dataset) -> dict:
    """A launch of two nodes (--rdzv-timeout 2) of which only this one starts, run to its end:
    its status, stderr, endpoint and whether it had written anything."""
    out = tmp_path_factory.mktemp("one-of-two") / "run"
    command = launch_one_of_two_nodes(out, small_dataset, "--rdzv-timeout", "2")
    with started(command, out) as run:
        wait_for_text(run, "launch: waiting")
        status = run.finish()
        stderr = run.stderr
    endpoint = command[command.index("--rdzv-endpoint") + 1]
    return {"status": status, "stderr": stderr, "endpoint": endpoint, "wrote": out.exists()}


def test_a_launch_waiting_for_another_node_says_once_for_whom_where_and_until_when(
    one_of_two_nodes,
):
    from megatronish.cli.training import launch as launch_command

    stderr = one_of_two_nodes["stderr"]
    waiting = [line for line in stderr.splitlines() if line.startswith("launch: ")]
    assert len(waiting) == 1, stderr  # said once, not repeated for as long as it waited
    pattern = (
        rf"launch: waiting for 1 more node\(s\) at {re.escape(one_of_two_nodes['endpoint'])} "
        r"\(2 nodes in all\); the rendezvous times out at \d\d:\d\d:\d\d \(2 s, --rdzv-timeout\)"
    )
    assert re.fullmatch(pattern, waiting[0]), waiting[0]
    (timeout,) = [p for p in launch_command.params if p.name == "rdzv_timeout"]
    assert timeout.default == 600, "a launch given no --rdzv-timeout waits 600 s"


def test_a_launch_whose_other_node_never_comes_exits_1_in_one_line_at_the_timeout(
    one_of_two_nodes,
):
    stderr = one_of_two_nodes["stderr"]
    lines = stderr.strip().splitlines()
    assert one_of_two_nodes["status"] == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert lines[-1].startswith("error: launch: not all 2 nodes joined the rendezvous at ")
    assert "within 2 s (--rdzv-timeout)" in lines[-1]
    assert not one_of_two_nodes["wrote"], "nothing written before the ranks started"


@contextlib.contextmanager
def held_port(listening: bool) -> Iterator[int]:
    """A port of this host that a socket of this process holds (listening, or only bound)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        if listening:
            holder.listen()
        yield holder.getsockname()[1]


def launch_node_0_of_2(out_dir: Path, dataset: Path, endpoint: str, program=MEGATRONISH):
    """`launch` of node 0 of 2 (--rdzv-timeout 600 s, beyond TIMEOUT), in a process of its own:
    one that waited for its rendezvous fails the test rather than hangs it (a thread blocked
    in the store's connect never returns to Python for pytest's timeout)."""
    args = config_args(out_dir, dataset, "parallel.tp=1", "parallel.dp=2")
    options = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint]
    command = [*program, "launch", *args, *options]
    return fork_run(command, TIMEOUT, env=environment())


def port_in_use(endpoint: str, port: int) -> str:
    return (
        f"error: launch: --rdzv-endpoint {endpoint}: port {port} is in use on this host by "
        "another process; pick a free port"
    )


@pytest.mark.parametrize("listening", [True, False], ids=["listening", "bound"])
def test_node_0_whose_rendezvous_port_another_process_holds_exits_2_naming_the_port(
    tmp_path, small_dataset, listening
):
    with held_port(listening) as port:
        endpoint = f"127.0.0.1:{port}"
        result = launch_node_0_of_2(tmp_path / "run", small_dataset, endpoint)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [port_in_use(endpoint, port)]
    assert not (tmp_path / "run").exists()


# `megatronish` whose launcher finds the rendezvous port free whatever holds it
PORT_CHECK_MISSES = (
    "from megatronish.commands import launch; launch.port_taken = lambda port: False; "
    "from megatronish.cli import main; main()"
)


def test_node_0_whose_rendezvous_port_is_taken_after_the_check_exits_2_as_torchrun_fails(
    tmp_path, small_dataset
):
    """The port taken between the launcher's check and torchrun's store: node 0 hosts the
    store (it never dials the holder), so torchrun fails at once, and the launch says so in
    the same line."""
    with held_port(listening=True) as port:
        endpoint = f"127.0.0.1:{port}"
        program = (sys.executable, "-c", PORT_CHECK_MISSES)
        result = launch_node_0_of_2(tmp_path / "run", small_dataset, endpoint, program)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == port_in_use(endpoint, port)
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------------------------
# The launcher killed, a second run meanwhile; restarts and preemption


@pytest.fixture(scope="module")
def killed_torchrun(tmp_path_factory, small_dataset) -> dict:
    """A run under plain torchrun with no end, which a second run (through launch, on the same
    checkpoint.dir) tries to join; after STEPS steps torchrun's process group gets kill -9. Its
    first STEPS losses are the curve of a run never interrupted."""
    root = tmp_path_factory.mktemp("killed")
    out, checkpoints = root / "first", root / "first" / "checkpoints"
    forever = config_args(out, small_dataset, "train.steps=100000", f"checkpoint.dir={checkpoints}")
    seen: dict = {"checkpoints": checkpoints}
    # torchrun itself, killed: a real one.
    command = [*TORCHRUN, "-m", "megatronish", "train", *forever]
    with started(command, out, real=True) as first:
        first.wait_for_step(2)
        seen["rank0"] = first.rank_pid(0)
        # The second run is refused before it starts a process: it runs in this one.
        again = config_args(root / "second", small_dataset, f"checkpoint.dir={checkpoints}")
        refused = invoke_cli("launch", *again, "--set", "train.steps=10")
        seen["second"] = (refused.returncode, refused.stderr)
        first.wait_for_step(STEPS)
        ranks = [first.rank_pid(0), first.rank_pid(1)]

        def left() -> list[int]:
            alive = {pid for pid in ranks if process_alive(pid)}  # a dying one has no cmdline
            return sorted(alive | set(processes_naming(first.marker)))

        os.killpg(first.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while left() and time.monotonic() < deadline:
            time.sleep(0.1)
        seen["left"] = left()
    seen["curve"] = training_curve(out)[:STEPS]
    return seen


def test_kill_9_of_torchrun_leaves_no_rank_after_10_s(killed_torchrun):
    assert killed_torchrun["left"] == [], "a rank outlived torchrun by 10 s"


def test_a_second_run_on_a_locked_checkpoint_dir_exits_2_naming_it_and_the_holder(killed_torchrun):
    status, stderr = killed_torchrun["second"]
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert str(killed_torchrun["checkpoints"]) in lines[0]
    assert f"pid {killed_torchrun['rank0']} " in lines[0], "rank 0 holds the lock"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, small_dataset) -> dict:
    """One run in two launches. The first (--max-restarts 1): kill -9 of rank 1 after step 3,
    then, once the restarted ranks are three steps further, SIGTERM to the launcher. The second:
    SIGUSR1 to rank 1 three steps after it resumed."""
    out = tmp_path_factory.mktemp("interrupted") / "run"
    phases: dict = {}
    restarting = launch(out, small_dataset, f"train.steps={STEPS}", options=("--max-restarts", "1"))
    with started(restarting, out, "restart") as run:
        killed_after = run.wait_for_step(3)
        os.kill(run.rank_pid(1), signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT
        while "resumed from" not in run.stdout:
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr[-3000:]
            time.sleep(0.02)
        run.wait_for_step(resumed_steps(run.stdout)[0] + 3)
        run.proc.send_signal(signal.SIGTERM)
        phases["restart"] = (run.finish(), run.stdout, run.stderr, killed_after, run.last_step())
    with started(launch(out, small_dataset, f"train.steps={STEPS}"), out, "sigusr1") as run:
        run.wait_for_step(phases["restart"][4] + 3)
        os.kill(run.rank_pid(1), signal.SIGUSR1)
        phases["sigusr1"] = (run.finish(), run.stdout, run.last_step())
    phases["curve"] = training_curve(out)
    phases["latest"] = (out / "checkpoints" / "latest").read_text().strip()
    return phases


def test_a_worker_killed_under_max_restarts_restarts_the_group_from_the_newest_checkpoint(
    interrupted,
):
    status, stdout, stderr, killed_after, _ = interrupted["restart"]
    assert status == 0, stderr[-3000:]
    (restarted,) = resumed_steps(stdout)
    # checkpoint.every=2: the newest checkpoint is at most two steps behind the kill.
    assert killed_after - 2 <= restarted, (restarted, killed_after)
    assert "Traceback" not in stderr, "the surviving rank exits with one line"


def test_sigterm_to_the_launcher_saves_at_the_step_boundary_and_the_next_launch_continues(
    interrupted,
):
    status, stdout, _, _, stopped = interrupted["restart"]
    assert status == 0
    assert stopped < STEPS
    assert f"stopped at step {stopped} of {STEPS} (SIGTERM): saved step {stopped}" in stdout
    assert resumed_steps(interrupted["sigusr1"][1]) == [stopped]


def test_sigusr1_to_one_rank_saves_on_every_rank_and_exits_0(interrupted):
    status, stdout, stopped = interrupted["sigusr1"]
    assert status == 0
    assert interrupted["restart"][4] + 3 <= stopped < STEPS
    assert f"stopped at step {stopped} of {STEPS} (asked on another rank)" in stdout
    assert interrupted["latest"] == f"step_{stopped:06d}"


def test_interrupted_runs_have_the_losses_of_an_uninterrupted_run(interrupted, killed_torchrun):
    curve, stopped = interrupted["curve"], interrupted["sigusr1"][2]
    never_stopped = killed_torchrun["curve"]
    assert [step for step, _ in curve] == list(range(1, stopped + 1)), "each step once"
    assert [step for step, _ in never_stopped] == list(range(1, STEPS + 1))
    for (step, loss), (_, expected) in zip(curve, never_stopped[:stopped], strict=True):
        assert loss == pytest.approx(expected, rel=EXACT, abs=EXACT), step


def train_command(out_dir: Path, dataset: Path, *overrides: str, faulty_script: bool = False):
    """`megatronish train` of one process (tests/faulty_rank.py's, with faulty_script)."""
    program = (
        [sys.executable, str(REPO / "tests" / "faulty_rank.py")] if faulty_script else MEGATRONISH
    )
    return [*program, "train", *config_args(out_dir, dataset, "parallel.tp=1", *overrides)]


def test_a_first_ctrl_c_stops_at_the_end_of_the_step_saves_and_the_run_resumes_from_it(
    tmp_path, small_dataset
):
    out = tmp_path / "run"
    with started(train_command(out, small_dataset, "train.steps=100000"), out) as run:
        run.wait_for_step(1)
        run.proc.send_signal(signal.SIGINT)
        status = run.finish()
        stdout, stderr = run.stdout, run.stderr
    assert status == 0, stderr[-3000:]
    notices = [line for line in stderr.splitlines() if line.startswith("interrupted: ")]
    stopped = max(x["step"] for x in metrics_lines(out))
    assert notices == [
        f"interrupted: stopping at the end of step {stopped} and saving; press Ctrl-C again to "
        "abort now"
    ], stderr[-3000:]
    assert f"stopped at step {stopped} of 100000 (SIGINT): saved step {stopped}" in stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:06d}"
    # The resumed run needs no signal: it runs in this process.
    again = config_args(out, small_dataset, "parallel.tp=1", f"train.steps={stopped + 2}")
    resumed = invoke_cli("train", *again)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_steps(resumed.stdout) == [stopped]
    assert [x["step"] for x in metrics_lines(out)] == list(range(1, stopped + 3))


def test_a_second_ctrl_c_aborts_at_once_with_130_leaving_no_unfinished_save(
    tmp_path, small_dataset
):
    out, marker = tmp_path / "run", tmp_path / "writer-holds"
    command = train_command(
        out, small_dataset, "train.steps=100000", "checkpoint.async=true", faulty_script=True
    )
    hold = dict(FAULT_RANK="0", FAULT_HOLD_WRITE_STEP="2", FAULT_HOLD_WRITE_S="120",
                FAULT_HOLD_MARKER=str(marker))  # fmt: skip
    with started(command, out, **hold) as run:
        wait_for_file(run, marker)  # step 2's save is in flight, held by its writer
        run.proc.send_signal(signal.SIGINT)
        wait_for_text(run, "interrupted: stopping at the end of step ")
        run.proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        status = run.finish()
        took = time.monotonic() - sent
        stderr = run.stderr
    assert status == 130, stderr[-3000:]
    assert took < 10, "a second Ctrl-C does not wait for the save in flight"
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("aborted: a second Ctrl-C"), stderr[-3000:]
    assert [p.name for p in (out / "checkpoints").iterdir() if ".tmp-" in p.name] == []


@pytest.mark.parametrize("held", ["run", "exit"])
def test_a_second_ctrl_c_once_the_save_is_on_disk_exits_0_with_no_traceback(
    tmp_path, small_dataset, held
):
    """The second Ctrl-C comes while the process, its checkpoint saved, is held at the end of
    the run (its stop handling still installed) or in an atexit callback as it exits."""
    out, marker = tmp_path / "run", tmp_path / "saved-and-held"
    command = train_command(out, small_dataset, "train.steps=100000", faulty_script=True)
    hold = dict(FAULT_RANK="0", FAULT_HOLD_DONE=held, FAULT_HOLD_DONE_MARKER=str(marker))
    with started(command, out, **hold) as run:
        run.wait_for_step(1)
        run.proc.send_signal(signal.SIGINT)
        wait_for_file(run, marker)
        run.proc.send_signal(signal.SIGINT)
        marker.unlink()  # ends the hold: the signal came first
        status = run.finish()
        stdout, stderr = run.stdout, run.stderr
    assert status == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert not [line for line in stderr.splitlines() if line.startswith("aborted")], stderr
    stopped = max(x["step"] for x in metrics_lines(out))
    assert f"stopped at step {stopped} of 100000 (SIGINT): saved step {stopped}" in stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:06d}"


# --------------------------------------------------------------------------------------------
# Injected faults


def faulty(out_dir: Path, dataset: Path, *overrides: str, torchrun: tuple[str, ...] = ()):
    script = str(REPO / "tests" / "faulty_rank.py")
    return [*TORCHRUN, *torchrun, script, "train", *config_args(out_dir, dataset, *overrides)]


def tensors(step_dir: Path, kind: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(step_dir.glob(f"{kind}_*.safetensors")):
        out.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    return out


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory, small_dataset) -> dict:
    """tp = 2 under torchrun, checkpoints at every step: rank 1's loss (and so its gradients)
    is NaN at step 3, while rank 0 computes a finite loss and learns of the NaN only through
    the step agreement; at step 5 rank 1 raises."""
    root = tmp_path_factory.mktemp("faulty")
    out, logs = root / "run", root / "logs"
    sets = ("train.steps=100000", "checkpoint.every=1", "checkpoint.keep=0",
            "parallel.timeout_s=30")  # fmt: skip
    command = faulty(
        out, small_dataset, *sets, torchrun=("--log-dir", str(logs), "--redirects", "3")
    )
    with started(command, out, FAULT_RANK="1", FAULT_NAN_STEPS="3", FAULT_RAISE_STEP="5") as run:
        run.wait_for_step(4)
        before = time.monotonic()
        status = run.finish()
        seen = {"status": status, "down_after": time.monotonic() - before, "out": out}
        seen["left"] = processes_naming(run.marker)
        seen["console"] = run.stdout + run.stderr
    seen["logs"] = {
        rank: next(logs.glob(f"**/attempt_0/{rank}/stderr.log")).read_text() for rank in (0, 1)
    }
    return seen


def test_a_non_finite_step_is_skipped_alike_on_every_rank_counted_and_never_saved(faulty_run):
    lines = metrics_lines(faulty_run["out"])
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 4]
    assert [x for x in lines if "skipped" in x] == [
        {"step": 3, "skipped": "non-finite loss and grad_norm", "skipped_in_a_row": 1}
    ]
    ckpt = faulty_run["out"] / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*")) == [f"step_{s:06d}" for s in range(1, 5)]
    for step in range(1, 5):
        for kind in ("model", "optim"):
            assert all(
                v.isfinite().all() for v in tensors(ckpt / f"step_{step:06d}", kind).values()
            )

    def same(a: int, b: int, kind: str) -> bool:
        x, y = tensors(ckpt / f"step_{a:06d}", kind), tensors(ckpt / f"step_{b:06d}", kind)
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    for kind in ("model", "optim"):  # no update at step 3, on either tp shard
        assert same(2, 3, kind), kind
        assert not same(3, 4, kind), "step 4 updates again"


def test_a_rank_that_raises_stops_every_rank_with_its_message_printed_once(faulty_run):
    assert faulty_run["status"] != 0
    assert faulty_run["down_after"] < 30, "every rank is down within parallel.timeout_s"
    assert faulty_run["left"] == []
    logs = faulty_run["logs"]
    message = "injected failure on rank 1 at step 5"
    assert sum(text.count(message) for text in [faulty_run["console"], *logs.values()]) == 1
    assert message in logs[1] and "Traceback" in logs[1]
    survivor = [line for line in logs[0].splitlines() if line.strip()]
    assert "Traceback" not in logs[0]
    assert [line for line in survivor if line.startswith("error:")] == [survivor[-1]]
    assert survivor[-1].startswith("error: rank 0: stopped because another rank failed (")


def test_max_skipped_steps_non_finite_in_a_row_stop_the_run_with_status_1(tmp_path, small_dataset):
    out = tmp_path / "run"
    sets = [*SMALL, "parallel.tp=1", f"data.path={small_dataset}", f"run.out_dir={out}",
            "train.steps=8", "checkpoint.every=1", "checkpoint.keep=0",
            "train.max_skipped_steps=2"]  # fmt: skip
    trainer = Trainer(setup(load_config(None, sets)))
    compute_gradients = trainer.compute_gradients

    def nan_from_step_3() -> tuple[float, float]:
        loss, grad_norm = compute_gradients()
        return (float("nan"), grad_norm) if trainer.step + 1 >= 3 else (loss, grad_norm)

    trainer.compute_gradients = nan_from_step_3
    with pytest.raises(RunFailure) as failed:
        trainer.run()
    assert failed.value.exit_status == 1 and failed.value.rank0_prints
    assert "steps 3 to 4" in str(failed.value) and "train.max_skipped_steps=2" in str(failed.value)
    lines = metrics_lines(out)
    assert [(x["step"], x["skipped_in_a_row"]) for x in lines if "skipped" in x] == [(3, 1), (4, 2)]
    assert all(x["skipped"] == "non-finite loss" for x in lines if "skipped" in x)
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert saved == ["step_000001", "step_000002", "step_000003"], "not the step that stopped it"


def test_a_rank_that_stops_calling_collectives_is_named_by_diagnose_from_every_ranks_dump(
    tmp_path, small_dataset
):
    """Rank 1 also starts 5 s after rank 0, past the 4 s timeout_s: joining the process group
    waits for every rank's start (distributed.layout.JOIN_S), the collectives after it do not.
    The ranks are forked as torchrun starts them: torchrun plays no part in the dumps."""
    out = tmp_path / "run"
    timeout_s = 4.0  # the watchdog reports a collective in flight for half of it, 2 s
    sets = ("train.steps=100000", f"parallel.timeout_s={timeout_s}")
    command = faulty(out, small_dataset, *sets)[len(TORCHRUN) :]
    faults = dict(FAULT_RANK="1", FAULT_HANG_STEP="3", FAULT_HANG_S="6", FAULT_START_S="5")
    with started([sys.executable, *command], out, ranks=2, **faults) as run:
        run.wait_for_step(2)
        stalled = time.monotonic()
        debug = out / "debug"
        while time.monotonic() - stalled < timeout_s + 10:
            if all((debug / f"rank_{r}.json").is_file() for r in (0, 1)):
                break
            time.sleep(0.2)
        written = time.monotonic() - stalled
        assert written <= timeout_s + 10, "every rank's dump within timeout_s + 10 s"
    # The dumps (written atomically) are what diagnose reads: the run was killed on leaving
    # the block rather than waited for until rank 1's hang and the timeout had run out.
    dump = json.loads((debug / "rank_0.json").read_text())
    waiting = dump["in_flight"]
    assert waiting is not None and waiting["group"] == "tp[0,1]"
    result = invoke_cli("diagnose", str(out))  # it only reads the dumps: in this process
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"rank 1 never entered {waiting['op']} #{waiting['seq']} on tp[0,1]")
    assert "rank 0 wait" in first
    assert "faulty_rank.py" in result.stdout  # rank 1's stack: where it is blocked
