"""Hang reports: the watchdog's dumps on a stalled run, SIGUSR2 and stale files, and
`diagnose_run`'s verdict on real and hand-written dumps."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from megatronish.commands.diagnose import diagnose_run, rank_list
from megatronish.config import Config
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.observe.flight import TRIGGER, Watchdog, watchdog_for
from megatronish.observe.record import RECORDER
from tests.conftest import run_cli
from tests.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # multi-rank runs that hang on purpose

HUNG_AFTER_S = 3.0


def _wait_for_dumps(out_dir: str, ranks, limit_s: float = 20.0) -> None:
    """Sleeps (outside any collective) until every rank in ranks has dumped, at most limit_s."""
    debug = Path(out_dir) / "debug"
    deadline = time.time() + limit_s
    while time.time() < deadline and not all((debug / f"rank_{r}.json").exists() for r in ranks):
        time.sleep(0.05)


def _stall(rank: int, world_size: int, out_dir: str) -> float:
    """tp = 2, dp = 2. After a few collectives, rank 3 stays out of its tp all-reduce (#3 on
    tp[2,3]) until every rank has dumped, so rank 2 waits there; a second later ranks 0 and 1
    wait in dp all-reduces behind ranks 2 and 3. Then rank 3 goes on and every collective
    completes. Returns when the stall began."""
    ps = ParallelState.from_world(2, 2)
    watchdog = Watchdog(out_dir, rank, world_size, HUNG_AFTER_S, poll_s=0.2).start()
    try:
        x = torch.ones(4)
        comm.all_reduce(x, ps.tp_group)
        comm.all_reduce(x, ps.tp_group)
        comm.all_reduce(x, ps.dp_group)
        stalled_at = time.time()
        if rank == 3:
            _wait_for_dumps(out_dir, range(world_size))
        if rank in (2, 3):
            comm.all_reduce(x, ps.tp_group)
        else:
            time.sleep(1.0)
        comm.all_reduce(x, ps.dp_group)
    finally:
        watchdog.close()
    return stalled_at


def _signalled(rank: int, world_size: int, out_dir: str) -> None:
    """Two ranks finish a collective; then rank 0 sends itself SIGUSR2 and both wait for the
    dumps."""
    watchdog = Watchdog(out_dir, rank, world_size, 30.0, poll_s=0.1).start()
    try:
        comm.all_reduce(torch.ones(2), None)
        if rank == 0:
            os.kill(os.getpid(), signal.SIGUSR2)
        _wait_for_dumps(out_dir, range(world_size))
    finally:
        watchdog.close()


def _reports(out_dir: Path, world_size: int) -> list[dict]:
    return [
        json.loads((out_dir / "debug" / f"rank_{r}.json").read_text()) for r in range(world_size)
    ]


@pytest.mark.timeout(60)
def test_a_stalled_rank_is_named_with_its_collective_and_stack(tmp_path):
    stalled_at = run_on_ranks(_stall, 4, str(tmp_path), timeout=30)[2]
    reports = _reports(tmp_path, 4)
    for report in reports:
        assert report["time"] - stalled_at < HUNG_AFTER_S + 10, report["reason"]
        assert report["world_size"] == 4
    assert reports[2]["in_flight"]["group"] == "tp[2,3]"
    assert reports[2]["in_flight"]["seq"] == 3
    assert reports[3]["in_flight"] is None  # rank 3 dumped on request, outside any collective
    assert reports[3]["reason"].startswith("asked by another rank: rank ")
    assert any("in flight for more than 3.0 s" in r["reason"] for r in reports)
    assert reports[3]["stacks"][0]["thread"] == "MainThread"

    text, status = diagnose_run(tmp_path)
    assert status == 0
    lines = text.splitlines()
    assert lines[0].startswith("rank 3 never entered all_reduce #3 on tp[2,3]; rank 2 waits there")
    assert lines[0].endswith("rank 3's stack:")
    assert "_wait_for_dumps" in text  # where rank 3 was
    assert lines[-1] == (
        "(2 other groups hang too: all_reduce #2 on dp[0,2], all_reduce #2 on dp[1,3])"
    )


@pytest.mark.timeout(60)
def test_sigusr2_dumps_every_rank_and_finds_no_hang(tmp_path):
    run_on_ranks(_signalled, 2, str(tmp_path), timeout=30)
    reports = _reports(tmp_path, 2)
    assert reports[0]["reason"] == "SIGUSR2"
    assert reports[1]["reason"] == "asked by another rank: rank 0: SIGUSR2"
    assert reports[0]["entries"][0]["group"] == "world"
    text, status = diagnose_run(tmp_path)
    assert status == 0
    assert text == (
        "no hang: no rank was inside a collective when the dumps were taken (2 dumps: ranks 0-1)"
    )


@pytest.mark.timeout(30)
def test_watchdog_clears_stale_files_answers_requests_and_restores_sigusr2(tmp_path):
    debug = tmp_path / "debug"
    debug.mkdir()
    for name in ("rank_0.json", TRIGGER):
        (debug / name).write_text("{}")
        os.utime(debug / name, (1e9, 1e9))  # from a run long ago
    before = signal.getsignal(signal.SIGUSR2)
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    watchdog = Watchdog(tmp_path, 0, 2, 30.0, poll_s=0.05).start()
    try:
        assert not (debug / "rank_0.json").exists() and not (debug / TRIGGER).exists()
        assert signal.getsignal(signal.SIGUSR2) is not before
        (debug / TRIGGER).write_text(json.dumps({"rank": 1, "reason": "SIGUSR2"}))
        _wait_for_dumps(str(tmp_path), [0], limit_s=5)
        report = json.loads((debug / "rank_0.json").read_text())
        assert report["reason"] == "asked by another rank: rank 1: SIGUSR2"
        assert "test_observe_hang.py" in report["stacks"][0]["stack"]
        dumped = watchdog.last_dump
        time.sleep(0.3)
        assert watchdog.last_dump == dumped  # once per request
    finally:
        watchdog.close()
    assert signal.getsignal(signal.SIGUSR2) is before
    assert signal.set_wakeup_fd(wakeup_fd) == wakeup_fd


def test_watchdog_for_follows_the_config(tmp_path):
    cfg = Config()
    cfg.run.out_dir = str(tmp_path)
    size = RECORDER.size
    try:
        cfg.observe.flight_recorder = 0
        assert watchdog_for(cfg, ParallelState.single()) is None
        assert RECORDER.size == 0
        cfg.observe.flight_recorder = 50
        watchdog = watchdog_for(cfg, ParallelState.single())
        watchdog.close()
        assert RECORDER.size == 50
        assert watchdog.timeout_s == cfg.parallel.timeout_s - 60
    finally:
        RECORDER.resize(size)


def _dump(tmp_path: Path, rank: int, entries, world_size: int = 4, at: float = 1000.0) -> None:
    """A hand-written dump: entries as (seq, op, group, start, end)."""
    keys = ("seq", "op", "group", "start", "end")
    rows = [dict(zip(keys, e)) for e in entries]
    report = {
        "rank": rank,
        "pid": 100 + rank,
        "reason": "test",
        "time": at,
        "world_size": world_size,
        "entries": rows,
        "in_flight": next((e for e in rows if e["end"] is None), None),
        "stacks": [{"thread": "MainThread", "stack": f'  File "train.py", line {rank}\n    f()\n'}],
    }
    (tmp_path / "debug").mkdir(exist_ok=True)
    (tmp_path / "debug" / f"rank_{rank}.json").write_text(json.dumps(report))


def test_diagnose_user_errors_are_one_line(tmp_path):
    for run_dir, names in [
        (tmp_path / "missing", "missing"),
        (tmp_path, "debug"),
    ]:
        text, status = diagnose_run(run_dir)
        assert status == 2 and "\n" not in text and names in text
    (tmp_path / "debug").mkdir()
    assert diagnose_run(tmp_path)[1] == 2
    (tmp_path / "debug" / "rank_0.json").write_text("{not json")
    text, status = diagnose_run(tmp_path)
    assert status == 2 and "\n" not in text and "rank_0.json: not valid JSON" in text
    (tmp_path / "debug" / "rank_0.json").write_text(json.dumps({"rank": 0}))
    text, status = diagnose_run(tmp_path)
    assert status == 2 and text.endswith("rank_0.json: not a hang report (no 'pid')")


def test_diagnose_names_a_member_that_wrote_no_dump(tmp_path):
    _dump(tmp_path, 0, [(5, "all_reduce", "tp[0,1]", 990.0, None)], world_size=2)
    text, status = diagnose_run(tmp_path)
    assert (text, status) == (
        "rank 1 wrote no dump (it may have exited); rank 0 waits for it in all_reduce #5 on "
        "tp[0,1] (in flight 10.0 s)",
        0,
    )


def test_diagnose_reports_the_earliest_of_two_hangs(tmp_path):
    _dump(tmp_path, 0, [(7, "all_gather", "tp[0,1]", 900.0, None)])
    _dump(tmp_path, 1, [(6, "all_gather", "tp[0,1]", 890.0, 891.0)])
    _dump(tmp_path, 2, [(4, "all_reduce", "tp[2,3]", 950.0, None)])
    _dump(tmp_path, 3, [(3, "all_reduce", "tp[2,3]", 940.0, 941.0)])
    text, status = diagnose_run(tmp_path)
    assert status == 0
    assert text.splitlines() == [
        "rank 1 never entered all_gather #7 on tp[0,1]; rank 0 waits there (in flight 100.0 s); "
        "rank 1's stack:",
        '      File "train.py", line 1',
        "        f()",
        "(1 other group hangs too: all_reduce #4 on tp[2,3])",
    ]


def test_diagnose_follows_a_waiting_rank_to_the_one_it_waits_for(tmp_path):
    # rank 0 waits (since 900) for rank 2, which waits (since 950) for rank 3, in user code
    _dump(tmp_path, 0, [(2, "all_reduce", "dp[0,2]", 900.0, None)])
    _dump(tmp_path, 1, [])
    _dump(tmp_path, 2, [(1, "all_reduce", "dp[0,2]", 800.0, 801.0),
                        (3, "all_reduce", "tp[2,3]", 950.0, None)])  # fmt: skip
    _dump(tmp_path, 3, [(2, "all_reduce", "tp[2,3]", 850.0, 851.0)])
    text, _ = diagnose_run(tmp_path)
    assert text.startswith("rank 3 never entered all_reduce #3 on tp[2,3]; rank 2 waits there")
    assert text.endswith("(1 other group hangs too: all_reduce #2 on dp[0,2])")


def test_diagnose_falls_back_to_point_to_point(tmp_path):
    _dump(tmp_path, 0, [(1, "all_reduce", "world", 900.0, 901.0)], world_size=2)
    _dump(tmp_path, 1, [(1, "all_reduce", "world", 900.0, 901.0), (4, "p2p", "p2p", 980.0, None)],
          world_size=2)  # fmt: skip
    text, _ = diagnose_run(tmp_path)
    assert text.startswith("rank 1 waits in point-to-point p2p (in flight 20.0 s; the peer is")
    assert "rank 1's stack:" in text


def test_diagnose_of_a_healthy_run_dumped_mid_step_finds_no_rank_stuck(tmp_path):
    # Rank 0 had just entered all_reduce #5 when it dumped; rank 1 dumped a moment before,
    # still computing: the dumps are not one instant, and nobody waits for anybody.
    _dump(tmp_path, 0, [(4, "all_reduce", "world", 990.0, 990.1),
                        (5, "all_reduce", "world", 1000.0, None)], world_size=2)  # fmt: skip
    _dump(tmp_path, 1, [(4, "all_reduce", "world", 990.0, 990.1)], world_size=2, at=999.9)
    expected = (
        "no rank is stuck: no collective had waited longer than 1 s for a rank seen outside it "
        "when the ranks dumped (2 dumps: ranks 0-1)"
    )
    assert diagnose_run(tmp_path) == (expected, 0)
    # rank 1 dumped 0.6 s after rank 0 entered, not yet there: 0.6 s of waiting is no hang
    _dump(tmp_path, 0, [(5, "all_reduce", "world", 999.4, None)], world_size=2)
    _dump(tmp_path, 1, [(4, "all_reduce", "world", 990.0, 990.1)], world_size=2, at=1000.0)
    assert diagnose_run(tmp_path) == (expected, 0)
    # both inside it, for a moment
    _dump(tmp_path, 1, [(5, "all_reduce", "world", 999.8, None)], world_size=2)
    assert diagnose_run(tmp_path) == (expected, 0)
    result = run_cli("diagnose", str(tmp_path), timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, expected + "\n", "")


def test_diagnose_names_a_rank_only_once_it_was_absent_past_the_threshold(tmp_path):
    # rank 0 entered #5 at 998.9 and dumped at 1000.0; rank 1's dump at 999.4 shows it absent
    # for 0.5 s only: no verdict. Rank 0 in it since 998.0: rank 1 was absent for 1.4 s.
    _dump(tmp_path, 0, [(5, "all_reduce", "world", 998.9, None)], world_size=2)
    _dump(tmp_path, 1, [(4, "all_reduce", "world", 990.0, 990.1)], world_size=2, at=999.4)
    assert diagnose_run(tmp_path)[0].startswith("no rank is stuck: ")
    _dump(tmp_path, 0, [(5, "all_reduce", "world", 998.0, None)], world_size=2)
    text, status = diagnose_run(tmp_path)
    assert status == 0
    assert text.startswith(
        "rank 1 never entered all_reduce #5 on world; rank 0 waits there (in flight 2.0 s)"
    )
    # a dump older than the waiter's by more than the threshold did not answer its request:
    # the rank counts as absent until the waiter dumped
    _dump(tmp_path, 0, [(5, "all_reduce", "world", 998.9, None)], world_size=2)
    _dump(tmp_path, 1, [(4, "all_reduce", "world", 990.0, 990.1)], world_size=2, at=990.5)
    assert diagnose_run(tmp_path)[0].startswith("rank 1 never entered all_reduce #5 on world")


def test_rank_lists_are_compressed():
    assert rank_list([3]) == "rank 3"
    assert rank_list([5, 0, 2, 1]) == "ranks 0-2, 5"
    assert rank_list([1, 3]) == "ranks 1, 3"
