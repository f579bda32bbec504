"""End to end: `megatronish train` gives the same loss curve at every layout. The tp = 2 and
dp = 2 runs are the command on two fork-served ranks as torchrun starts them (tests/ranks.py);
one `megatronish launch` (tp 2 x dp 2) is a real launcher and its ranks real processes, so its
stderr holds whatever a launch prints; the single-process references and the runs of the
Triton kernels under its interpreter run in this one (invoke_cli)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, SMALLEST_RUN, finish, invoke_cli, read_metrics
from tests.ranks import run_cli_on_ranks
from tests.tolerances import CURVE_REL, KERNEL_REL

pytestmark = pytest.mark.slow  # the CLI trains end to end

TINY = [
    "model.n_layer=2",
    "model.d_model=64",
    "model.max_seq_len=64",
    "train.seq_len=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=20",
    "train.log_every=1",
    "train.eval_every=10",
    "train.eval_steps=1",
]
ARCH = {
    "gpt2": ["model.arch=gpt2", "model.n_head=4"],
    "llama": ["model.arch=llama", "model.n_head=4", "model.n_kv_head=2"],
}


def _args(out, overrides: list[str]) -> list[str]:
    sets = [f"run.out_dir={out}", "checkpoint.save=false"]
    return [
        "--config",
        str(CONFIGS / "tiny.yaml"),
        *(a for o in overrides + sets for a in ("--set", o)),
    ]


# The run directory of each train_here run -> the last line it printed.
FINAL_LINES: dict[Path, str] = {}


def train_here(tmp_path, name: str, overrides: list[str], env: dict | None = None):
    """`megatronish train` in this process (with env set while it runs); its metrics."""
    result = invoke_cli("train", *_args(tmp_path / name, overrides), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    FINAL_LINES[tmp_path / name] = result.stdout.strip().splitlines()[-1]
    return read_metrics(tmp_path / name)


def assert_same_curve(a, b, rtol=CURVE_REL):
    (train_a, val_a), (train_b, val_b) = a, b
    assert [x["step"] for x in train_a] == [x["step"] for x in train_b] == list(range(1, 21))
    for x, y in zip(train_a + val_a, train_b + val_b):
        key = "loss" if "loss" in x else "val_loss"
        assert abs(x[key] - y[key]) <= rtol * abs(y[key]), (x, y)


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    """The run directory of an arch at tp = 1, trained once for all the tests of this module."""
    runs = {}

    def run(arch: str):
        if arch not in runs:
            root = tmp_path_factory.mktemp(f"tp1-{arch}")
            train_here(root, "tp1", TINY + ARCH[arch])
            runs[arch] = root / "tp1"
        return runs[arch]

    return run


def _side_dir(tmp_path_factory, name: str):
    return tmp_path_factory.getbasetemp() / f"side-{name}"


def _side_run(name: str, command: str, overrides: list[str]):
    """A run that is a side check (conftest): started with the session, as it takes a core for
    longer than its test's own work. Its output goes to _side_dir(name)."""

    def start_it(tmp_path_factory):
        out = _side_dir(tmp_path_factory, name)
        out.mkdir()
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        args = _args(out / "run", overrides)
        return [sys.executable, "-m", "megatronish", command, *args], full_env

    return start_it


def side_metrics(side_checks, tmp_path_factory, test: str, name: str):
    """The metrics of a side run, once it has finished with no warning on its stderr."""
    result = finish(side_checks.pop(test), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_warnings(result.stderr)
    return read_metrics(_side_dir(tmp_path_factory, name) / "run")


def assert_no_warnings(stderr: str) -> None:
    """stderr holds no Python warning (FutureWarning, UserWarning, ...) and no profiler marker
    line (USDT: ...)."""
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines()]
    noise = [line for line in lines if "Warning" in line or line.startswith("USDT:")]
    assert not noise, stderr[-3000:]


LAYOUTS = {"tp2": ["parallel.tp=2"], "dp2": ["parallel.dp=2"]}
EQUAL_CASES = [f"{arch} {layout}" for arch in ARCH for layout in LAYOUTS]


@pytest.mark.slow
@pytest.mark.parametrize("case", EQUAL_CASES)
def test_cli_losses_equal_at_tp1_tp2_and_dp2_with_no_warnings_on_stderr(tmp_path, case, tp1_run):
    arch, layout = case.split()
    out = tmp_path / "run"
    ranks = run_cli_on_ranks(["train", *_args(out, TINY + ARCH[arch] + LAYOUTS[layout])], 2)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        assert_no_warnings(result.stderr)
    tp1 = read_metrics(tp1_run(arch))
    assert_same_curve(read_metrics(out), tp1)
    losses = [x["loss"] for x in tp1[0]]
    assert losses[-1] < losses[0] - 0.5, "the model learns"


MIXED = ["parallel.tp=2", "parallel.dp=2", "optim.zero=1", "parallel.sequence_parallel=true"]
LAUNCH_TEST = "test_cli_launch_at_tp2_dp2_with_zero1_and_sp_matches_tp1_with_no_warnings_on_stderr"


@pytest.mark.slow
def test_cli_launch_at_tp2_dp2_with_zero1_and_sp_matches_tp1_with_no_warnings_on_stderr(
    tmp_path_factory, side_checks, tp1_run
):
    launched = side_metrics(side_checks, tmp_path_factory, LAUNCH_TEST, "tp2dp2")
    assert_same_curve(launched, read_metrics(tp1_run("llama")))


def test_train_writes_metrics_and_resolved_config_and_ends_with_a_line_that_gives_its_mfu(
    tp1_run,
):
    lines, evals = read_metrics(tp1_run("gpt2"))
    final = r"step 20: loss [\d.]+, val_loss [\d.]+, \d+ tokens/s, MFU \d+\.\d% \(vs .+\)"
    assert re.fullmatch(final, FINAL_LINES[tp1_run("gpt2")])
    assert [x["step"] for x in lines] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
        assert all(key in x for x in lines), key
    assert [x["step"] for x in evals] == [10, 20]
    assert (tp1_run("gpt2") / "config.yaml").is_file()


TRITON_TINY = [
    *SMALLEST_RUN,
    "train.steps=4",  # interpreted Triton takes about a second a step
    "train.warmup_steps=0",  # full steps from the first: a wrong gradient shows in the loss
    "train.log_every=1",
    "train.eval_every=0",
]


SIDE_CHECKS = {LAUNCH_TEST: _side_run("tp2dp2", "launch", TINY + ARCH["llama"] + MIXED)}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cli_triton_kernels_interpreted_give_the_torch_losses(tmp_path, arch):
    """Both runs in this process, whose kernels were imported under Triton's interpreter where
    there is no GPU (tests/kernel_env.py): the backend reads TRITON_INTERPRET as it runs."""
    pytest.importorskip("triton")
    settings = TRITON_TINY + [f"model.arch={arch}"]
    torch_lines, _ = train_here(tmp_path, "torch", settings + ["kernels.backend=torch"])
    triton = settings + ["kernels.backend=triton"]
    triton_lines, _ = train_here(tmp_path, "triton", triton, env={"TRITON_INTERPRET": "1"})
    assert [x["step"] for x in triton_lines] == [x["step"] for x in torch_lines] == [1, 2, 3, 4]
    for x, y in zip(triton_lines, torch_lines):
        for key in ("loss", "grad_norm"):  # the forward, and every kernel's backward
            assert y[key] > 0 and abs(x[key] - y[key]) <= KERNEL_REL * y[key], (key, x, y)
