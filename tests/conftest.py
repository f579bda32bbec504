"""Shared test set-up: one built-in-corpus cache per test session, and CLI helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """The built-in corpus is prepared once per session into a temporary cache, which the CLI
    subprocesses inherit through the environment."""
    if "MEGATRONISH_TEST_CACHE" in os.environ:
        os.environ["MEGATRONISH_CACHE"] = os.environ["MEGATRONISH_TEST_CACHE"]
    else:
        os.environ["MEGATRONISH_CACHE"] = str(tmp_path_factory.mktemp("megatronish-cache"))
    yield


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd=None):
    """`python -m megatronish ARGS` in a subprocess; returns the CompletedProcess."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, "-m", "megatronish", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or REPO,
    )


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of a run's metrics.jsonl."""
    lines = [
        json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return [x for x in lines if "loss" in x], [x for x in lines if "val_loss" in x]
