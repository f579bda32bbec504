"""Shared test set-up: a working directory and a built-in-corpus cache of the session's own (the
checkout's runs/, data/ and the user's cache are never read or written), the datasets several
test modules train on (prepared once per session), a disk too small for a command's output, and
CLI helpers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

# The kernels are imported first under Triton's interpreter where there is no GPU (tests/
# kernel_env.py), before any test module can import them otherwise: a module that imports them
# first without it (torchao's fp8 tests, through megatronish.fp8) left compiled-mode helpers that
# an interpreted kernel cannot call, failing the kernel tests a process ran after it.
import tests.kernel_env  # noqa: F401
from megatronish.cli import cli

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
# What a user's working directory in the checkout has that the tests' commands name as a user
# does (`--config configs/tiny.yaml`, `python scripts/...`, `--input docs/`), linked into each
# working directory the tests give their commands.
CHECKOUT_LINKS = ("configs", "docs", "scripts")
# What the README's main job and a user's other commands write into the checkout and into their
# cache: what the tests must never read or write (a user runs the main job before `pytest`).
USER_STATE = ("runs", "data")
# The smallest run the CLI tests train: one block of d_model 32, sequences of 16 tokens, a global
# batch of one micro-batch of 2 (each test adds its steps, logging and evaluation).
SMALLEST_RUN = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.max_seq_len=16",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


# Each test module's recorded wall time (seconds, its tests' setup, call and teardown summed),
# written by `pytest --record-durations`. Under pytest-xdist (the suite's two workers:
# pyproject's addopts, --no-loadscope-reorder keeping this order where xdist would put the
# modules of most tests first) the modules are handed out longest first, so that neither worker
# is left with a long one at the end while the other has nothing to do. Only an order: a module
# not recorded (after the recorded ones, in collection order), or one that got faster, changes
# the suite's time, not its result.
DURATIONS = Path(__file__).parent / "durations.json"


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write each test module's wall time to tests/durations.json (the handout order)",
    )


def _module(nodeid: str) -> str:
    """A test's module relative to tests/ ('project/test_docs.py')."""
    return nodeid.split("::")[0].removeprefix("tests/")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the modules' tests longest module first (each module's in its own
    order, DURATIONS); the modules not recorded after them, in collection order."""
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker
        return
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def position(item) -> tuple[int, float]:
        seconds = recorded.get(_module(item.nodeid))
        return (1, 0.0) if seconds is None else (0, -seconds)

    items.sort(key=position)  # stable: a module's tests keep their order


# Each module's seconds so far in this process (with xdist, the controller gets every report).
_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module = _module(report.nodeid)
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With --record-durations, writes DURATIONS from this session's reports, longest first (in
    the only process, or xdist's controller)."""
    if session.config.getoption("--record-durations") and not hasattr(
        session.config, "workerinput"
    ):
        ordered = sorted(_module_seconds.items(), key=lambda kv: -kv[1])
        DURATIONS.write_text(json.dumps({m: round(s, 1) for m, s in ordered}, indent=1) + "\n")


def link_checkout(directory: Path) -> Path:
    """directory with links to the checkout's CHECKOUT_LINKS, as a user's working directory in
    the repository root has them (made if missing); returns directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in CHECKOUT_LINKS:
        (directory / name).symlink_to(REPO / name, target_is_directory=True)
    return directory


def _user_state(cache: Path) -> dict[str, tuple[int, int]]:
    """(size, modification time) of every file and directory under the checkout's USER_STATE
    folders and the user's cache."""
    state = {}
    for root in [*(REPO / name for name in USER_STATE), cache]:
        for path in [root, *root.rglob("*")] if root.exists() else []:
            stat = path.lstat()
            state[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return state


@pytest.fixture(scope="session", autouse=True)
def _working_directory(tmp_path_factory):
    """The session runs in a temporary working directory with links to the checkout's configs/,
    docs/ and scripts/ (link_checkout), and commands started by the tests run there too, with the
    checkout first on PYTHONPATH as a command started in it has it on sys.path: what a
    command writes or reads by a relative default (`runs/tiny/checkpoints`, `data/...`) is the
    session's own, never the checkout's. Fails the session if the checkout's runs/ or data/ or
    the user's cache changed while it ran."""
    from megatronish.data.cache import cache_root

    user_cache = cache_root()
    before = _user_state(user_cache)
    previous, path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(link_checkout(tmp_path_factory.mktemp("cwd")))
    # A `python -c` or `-m` started in the checkout had it first on sys.path (`from tests...`).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), path) if p)
    yield
    os.chdir(previous)
    if path is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = path
    after = _user_state(user_cache)
    changed = sorted(
        path for path in before.keys() | after.keys() if before.get(path) != after.get(path)
    )
    assert not changed, f"the tests changed the user's files: {', '.join(changed[:5])}"


@pytest.fixture(scope="session", autouse=True)
def _session_cache(_working_directory, tmp_path_factory):
    """The built-in corpus is prepared once per session into a temporary cache, which the CLI
    subprocesses inherit through the environment. It is prepared here, before any test, so no
    command a test runs prints the line that says it prepares it."""
    from megatronish.data import builtin_dataset_dir

    if "MEGATRONISH_TEST_CACHE" in os.environ:
        os.environ["MEGATRONISH_CACHE"] = os.environ["MEGATRONISH_TEST_CACHE"]
    else:
        os.environ["MEGATRONISH_CACHE"] = str(tmp_path_factory.mktemp("megatronish-cache"))
    builtin_dataset_dir()
    yield


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """This process computes on one thread, as the ranks (tests/ranks.py) and the CLI
    subprocesses of the tests do: the tests' models are tiny, so a second thread gains little,
    and beside the ranks and subprocesses that share the cores its OpenMP barriers spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """The parity tests' dataset (tests/parity.py): ten documents of small Python functions,
    byte-level, a tenth for validation. Prepared once per session; nothing writes to it."""
    from tests.parity import prepare_code_dataset

    return prepare_code_dataset(tmp_path_factory.mktemp("parity-data"))


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """~400 KB of the standard library's json and email sources, byte-level, a fifth for
    validation (tests/checkpoints.py). Prepared once per session; nothing writes to it."""
    from tests.checkpoints import prepare_small_dataset

    return prepare_small_dataset(tmp_path_factory.mktemp("data") / "small")


@pytest.fixture
def full_disk(tmp_path):
    """A disk too small for a command's output (tests/disk.py): a 64 kB tmpfs where this process
    may mount one, else a file-size limit of 64 kB on the command's process."""
    from tests.disk import small_disk

    with small_disk(tmp_path / "small-disk") as disk:
        yield disk


@pytest.fixture
def interpreter_env(monkeypatch):
    """TRITON_INTERPRET as it was when the kernels were defined (tests/kernel_env.py), for the
    kernel test modules (`pytestmark = pytest.mark.usefixtures("interpreter_env")`)."""
    from tests.kernel_env import INTERPRET

    if INTERPRET is not None:
        monkeypatch.setenv("TRITON_INTERPRET", INTERPRET)


@dataclass
class Started:
    """A command started by `start`, still running, with the files its output goes to."""

    proc: subprocess.Popen
    stdout: IO[bytes]
    stderr: IO[bytes]


def start(command: list[str], env: dict | None = None, cwd=None) -> Started:
    """command started in a subprocess (in cwd, by default the session's working directory), to
    `finish`: commands that do not depend on each other
    run side by side (each writes to its own temporary files, so one that is not being waited
    for never blocks on a full pipe)."""
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
    return Started(proc, stdout, stderr)


def finish(started: Started, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CompletedProcess of a started command; killed, and an error, after timeout s."""
    proc = started.proc
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        outputs = []
        for file in (started.stdout, started.stderr):
            file.seek(0)
            outputs.append(file.read().decode(errors="replace"))
            file.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, *outputs)


class SideChecks:
    """The side checks of a session: `pop(test name)` gives the test its check's Started, the
    one started with the session or, where none was, one started now (None: the check cannot
    run here, or the test was not selected)."""

    def __init__(self, factories: dict, tmp_path_factory):
        self.factories, self.tmp_path_factory = factories, tmp_path_factory
        self.started: dict[str, Started] = {}

    def start(self, name: str) -> Started | None:
        command = self.factories[name](self.tmp_path_factory)
        return None if command is None else start(*command)

    def pop(self, name: str, default=None) -> Started | None:
        if name in self.started:
            return self.started.pop(name)
        return self.start(name) if name in self.factories else default


@pytest.fixture(scope="session", autouse=True)
def side_checks(request, tmp_path_factory):
    """Checks that only wait on a subprocess, started as the session starts so that they run
    beside the tests before them: a test module's SIDE_CHECKS maps a test's name to a function
    of tmp_path_factory giving (command, env), or None when the check cannot run. Yields the
    SideChecks of the selected tests; the test finishes its own (pops it). Under pytest-xdist
    (workers that each run a share of the modules) nothing starts early, since a worker cannot
    tell which tests it will get: a test starts its check when it pops it."""
    factories = {}
    for item in request.session.items:
        factory = getattr(item.module, "SIDE_CHECKS", {}).get(item.name)
        if factory is not None:
            factories[item.name] = factory
    checks = SideChecks(factories, tmp_path_factory)
    if "PYTEST_XDIST_WORKER" not in os.environ:
        for name in factories:
            started = checks.start(name)
            if started is not None:
                checks.started[name] = started
    yield checks
    for leftover in checks.started.values():  # never waited for: its test did not run to end
        leftover.proc.kill()
        finish(leftover)


def start_cli(*args: str, env: dict | None = None, cwd=None) -> Started:
    """`python -m megatronish ARGS` started in a subprocess (one thread), to `finish`."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    return start([sys.executable, "-m", "megatronish", *args], full_env, cwd)


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd=None):
    """`python -m megatronish ARGS` in a subprocess; returns the CompletedProcess."""
    return finish(start_cli(*args, env=env, cwd=cwd), timeout)


# Set by torch itself the first time anything imports torch._dynamo (torch.optim does).
_SET_BY_TORCH = {"TORCHINDUCTOR_CACHE_DIR"}


def _process_state() -> tuple:
    """What a command run in this process must leave as it found it."""
    environ = {k: v for k, v in os.environ.items() if k not in _SET_BY_TORCH}
    handlers = tuple(signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM))
    return environ, torch.get_num_threads(), dist.is_initialized(), handlers


def invoke_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`megatronish ARGS` in this process (click's test runner), as the CompletedProcess that
    run_cli would give: an exception other than exit is printed to stderr as a traceback with
    status 1, as Python would. No interpreter and no torch import of its own: for user errors,
    `check`, and single-process runs (run_cli keeps the end-to-end runs in a real process).
    Fails the test if the command leaves this process changed (environment, torch threads, a
    process group, signal handlers). Like run_cli's process it computes on one thread; torch's
    thread count and global random state are put back afterwards."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    torch.set_num_threads(1)
    try:
        before = _process_state()
        result = CliRunner().invoke(cli, list(args), env=env, prog_name="megatronish")
        after = _process_state()
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    assert after == before, "the command changed the state of the process it ran in"
    return subprocess.CompletedProcess(
        ["megatronish", *args], result.exit_code, result.stdout, stderr
    )


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of a run's metrics.jsonl."""
    lines = [
        json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return [x for x in lines if "loss" in x], [x for x in lines if "val_loss" in x]
