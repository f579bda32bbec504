"""The suite is hermetic: it runs, and starts its commands, in a working directory of its own
that links the checkout's configs/, docs/ and scripts/, so the main job's runs/tiny in the
checkout (the README runs it before `pytest`) is never read, and nothing lands in the checkout's
runs/ or data/ (tests/conftest.py fails a session that changed them or the user's cache)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatronish.data.cache import cache_root
from tests.conftest import CHECKOUT_LINKS, REPO, finish, start


def test_the_session_works_outside_the_checkout_with_links_to_what_commands_name():
    cwd = Path.cwd().resolve()
    assert cwd != REPO and REPO not in cwd.parents
    assert {name: (cwd / name).resolve() for name in CHECKOUT_LINKS} == {
        name: REPO / name for name in CHECKOUT_LINKS
    }
    assert (cwd / "configs" / "tiny.yaml").is_file()


def test_commands_started_by_the_tests_run_in_the_sessions_directory_and_cache():
    code = (
        "import os; from megatronish.data.cache import cache_root; print(os.getcwd(), cache_root())"
    )
    done = finish(start([sys.executable, "-c", code], env=dict(os.environ)), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [os.getcwd(), str(cache_root())]
    assert cache_root() != Path.home() / ".cache" / "megatronish"
