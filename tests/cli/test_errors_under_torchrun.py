"""A config error under torchrun is the same on every rank: rank 0 says it, once, and the other
ranks exit quietly; `megatronish launch` finds it before starting any rank and says it once."""

from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import CONFIGS, invoke_cli
from tests.forked import fork_run

pytestmark = pytest.mark.slow  # torchrun runs with bad configs

BAD_LAYOUT = ["--set", "model.n_head=3", "--set", "parallel.tp=2"]
MESSAGE = "model.n_head: 3 is not divisible by parallel.tp=2"


def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    """torchrun forked from the fork server (tests/forked.py); its ranks, real interpreters that
    import torch and fail."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "megatronish", "train", "--config", str(CONFIGS / "tiny.yaml"), *BAD_LAYOUT,
        "--set", f"run.out_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = fork_run(command, 120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    combined = result.stdout + result.stderr
    assert combined.count(MESSAGE) == 1, combined[-3000:]


def test_launch_says_a_config_error_once_and_exits_2(tmp_path):
    out = ["--set", f"run.out_dir={tmp_path / 'run'}"]
    result = invoke_cli("launch", "--config", str(CONFIGS / "tiny.yaml"), *BAD_LAYOUT, *out)
    assert result.returncode == 2
    assert (result.stdout + result.stderr).count(MESSAGE) == 1
    # tp 3 would divide the heads but not d_model: no tp passes every check, and it says why.
    assert result.stderr.strip().splitlines() == [
        f"error: {MESSAGE}; valid tp: none (at parallel.tp=1: model.d_model: 128 is not "
        "divisible by model.n_head=3)"
    ]
    assert not (tmp_path / "run").exists()
