"""The multi-process test helper: each call runs on fresh ranks that see the caller's environment
and nothing an earlier call left; a rank's exception, death or hang fails only that call. A
command forked from the same server (tests/forked.py) exits as a started interpreter would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.forked import fork_popen
from tests.ranks import run_on_ranks


def _leave_state_behind(rank, world):
    dist.new_group(list(range(world)))
    torch.manual_seed(1000 + rank)
    os.environ["LEFT_BEHIND"] = "1"
    return os.getpid()


def _state(rank, world):
    return dict(
        pid=os.getpid(),
        groups=len(dist.distributed_c10d._world.pg_map),
        draw=torch.rand(3),
        left=os.environ.get("LEFT_BEHIND"),
        mine=os.environ.get("CALLERS_VALUE"),
        threads=torch.get_num_threads(),
        world=dist.get_world_size(),
    )


def test_each_call_gets_fresh_ranks_with_the_callers_environment(monkeypatch):
    pids = run_on_ranks(_leave_state_behind, 2, timeout=60)
    monkeypatch.setenv("CALLERS_VALUE", "set after the first call")
    first, second = run_on_ranks(_state, 2, timeout=60)
    assert not {first["pid"], second["pid"]} & set(pids)
    assert first["groups"] == second["groups"] == 1, "only the default group"
    assert torch.equal(first["draw"], second["draw"]), "the default seed, as in a new process"
    assert first["left"] is None and first["mine"] == "set after the first call"
    assert (first["threads"], first["world"]) == (1, 2)


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for rank 1, which never comes
    return rank


def _die_on_rank_0(rank, world):
    dist.barrier()  # rank 1 has joined the group (rank 0 serves its store) before rank 0 dies
    if rank == 0:
        os._exit(3)
    time.sleep(60)  # no collective: only the parent can notice that rank 0 is gone


def _hang(rank, world):
    time.sleep(60)


def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_the_next_call_works():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: rank one is broken"):
        run_on_ranks(_fail_on_rank_1, 2, timeout=60)
    assert time.monotonic() - started < 30, "the waiting rank is stopped, not waited for"
    assert run_on_ranks(_state, 2)[1]["world"] == 2


@pytest.mark.slow  # waits out a hang timeout
def test_a_rank_that_dies_or_hangs_fails_the_call_without_waiting_for_the_others():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 exited with status 3"):
        run_on_ranks(_die_on_rank_0, 2, timeout=60)
    assert time.monotonic() - started < 30
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        run_on_ranks(_hang, 2, timeout=2)
    assert time.monotonic() - started < 45


# A program that says where it runs, then ends by sys.exit(3), an uncaught KeyboardInterrupt or
# a signal (sleeping until it comes); its worker thread and atexit callback say when they ran.
PROGRAM = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit", flush=True))
print(sys.argv[1:], os.getcwd(), os.environ.get("FORKED_VALUE"))
print("to stderr", file=sys.stderr)
threading.Thread(target=lambda: (time.sleep(0.2), print("thread"))).start()
if sys.argv[1] == "exit":
    sys.exit(3)
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
time.sleep(120)
"""


def test_a_forked_command_exits_as_a_started_interpreter_would(tmp_path):
    def forked(how: str):
        files = dict(stdout=tmp_path / f"{how}.out", stderr=tmp_path / f"{how}.err")
        env = dict(os.environ, FORKED_VALUE="given")
        command = [sys.executable, "-c", PROGRAM, how]
        return fork_popen(command, env=env, cwd=tmp_path, **files), *files.values()

    exits, out, err = forked("exit")
    assert exits.wait(timeout=60) == 3 == exits.returncode
    said = f"['exit'] {tmp_path} given"
    assert out.read_text().splitlines() == [said, "thread", "atexit"]  # threads, then atexit
    assert err.read_text() == "to stderr\n"
    interrupted, out, err = forked("interrupt")
    assert interrupted.wait(timeout=60) == -signal.SIGINT
    assert "KeyboardInterrupt" in err.read_text() and out.read_text().endswith("atexit\n")
    waiting, out, _ = forked("wait")
    deadline = time.monotonic() + 60
    while not out.read_text():  # written through: there before the process ends
        assert time.monotonic() < deadline, "nothing written within 60 s"
        time.sleep(0.01)
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.1)
    assert waiting.poll() is None
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=60) == -signal.SIGTERM
