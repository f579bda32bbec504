"""Profiler traces per rank (megatronish.observe.profile) and their merge (`megatronish trace`):
two gloo ranks trace steps 3:4 of a small workload of matmuls and collectives; the merged trace
has both ranks and their collective ranges, and the time table adds up."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections import Counter

import pytest
import torch

from megatronish.cli.shared import user_errors
from megatronish.commands.trace import merge_traces, step_breakdown
from megatronish.config import Config
from megatronish.distributed import comm
from megatronish.observe import profile
from megatronish.observe.profile import StepProfiler, annotate, comm_range
from megatronish.observe.quiet import native_noise_filtered
from tests.parity import GPT2, make_config, make_trainer
from tests.ranks import run_on_ranks
from tests.tolerances import TRACE_PARTS_REL

pytestmark = pytest.mark.slow  # multi-rank runs under the profiler


def _profiled_workload(rank: int, world_size: int, out_dir: str) -> list[bool]:
    """Four steps of matmuls, an all-reduce, an all-gather and an exchange with the other rank,
    steps 3:4 profiled; whether annotate's ranges were on in each step and after close()."""
    cfg = Config()
    cfg.observe.profile_steps, cfg.run.out_dir = "3:4", out_dir
    profiler = StepProfiler(cfg, rank, torch.device("cpu"))
    x = torch.randn(96, 96)
    gathered, received = torch.empty(2 * 96, 96), torch.empty(96, 96)
    recording = []
    for step in range(1, 5):
        profiler.begin_step(step)
        recording.append(profile._RECORDING)
        with annotate("block 0"):
            y = x @ x
            for _ in range(rank):  # rank 1 computes longer; rank 0 waits in the collective
                y = (y @ x).tanh()
        with comm_range("all_reduce", "tp[0,1]"):
            comm.all_reduce(y, None)
        with comm_range("all_gather", "tp[0,1]"):
            comm.all_gather_into(gathered, y, None)
        with comm_range("p2p", "p2p"):
            comm.exchange([(y, 1 - rank)], [(received, 1 - rank)])
        profiler.end_step(step)
    profiler.close()
    return [*recording, profile._RECORDING]


def _table_rows(text: str) -> dict[int, list[float]]:
    """{rank: [step, compute, comm, bubble] ms} from merge_traces' time table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "traced"]) + 1
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        rank, *values = line.split()
        rows[int(rank)] = [float(v) for v in values[:4]]
    return rows


def test_two_ranks_trace_steps_and_merge_with_no_profiler_markers_on_stderr(tmp_path, capfd):
    results = run_on_ranks(_profiled_workload, 2, str(tmp_path), timeout=120)
    assert results == [[False, False, True, True, False]] * 2
    assert "profiler_st" not in capfd.readouterr().err  # kineto's USDT lines, filtered
    traces = tmp_path / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["rank_0.json.gz", "rank_1.json.gz"]

    text, status = merge_traces(tmp_path)
    assert status == 0
    merged = json.loads((traces / "merged.json").read_text())
    ranges = [
        e for e in merged["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "user_annotation"
    ]
    names = {e["pid"]: set() for e in ranges}
    for event in ranges:
        names[event["pid"]].add(event["name"].rsplit(":", 1)[0])
    assert sorted(names) == [0, 1]
    for pid in (0, 1):
        assert {"step 3", "step 4", "block 0"} <= names[pid]
        assert {"comm:all_reduce", "comm:all_gather", "comm:p2p"} <= names[pid]
        assert not {"step 1", "step 2"} & names[pid]
    labels = {
        e["pid"]: e["args"]["name"]
        for e in merged["traceEvents"]
        if e.get("name") == "process_name"
    }
    assert labels == {0: "rank 0", 1: "rank 1"}

    assert "ms per rank, summed over the 2 traced steps (3 to 4)" in text
    rows = _table_rows(text)
    assert sorted(rows) == [0, 1]
    for step, compute, exposed, bubble in rows.values():
        assert step > 0 and exposed > 0 and bubble > 0
        assert compute + exposed + bubble == pytest.approx(step, rel=TRACE_PARTS_REL)
    assert "all_reduce" in text and "all_gather" in text


def test_step_breakdown_counts_overlapping_ranges_once():
    def span(name, start, end):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": start, "dur": end - start}

    events = [
        span("step 3", 0, 1000),
        span("comm:all_reduce:tp[0,1]", 100, 300),
        span("comm:all_reduce:tp[0,1]", 150, 250),  # nested in the one above
        span("comm:p2p:p2p", 500, 700),
        span("comm:all_gather:tp[0,1]", 600, 800),  # its first half is bubble already
        span("comm:broadcast:world", 2000, 2100),  # outside the step
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step 3", "ts": 0, "dur": 5000},
    ]
    times = step_breakdown(events)
    assert times["step"] == pytest.approx(1.0)
    assert times["comm"] == pytest.approx(0.3)
    assert times["bubble"] == pytest.approx(0.2)
    assert times["compute"] == pytest.approx(0.5)
    assert times["kinds"] == {"all_reduce": (0.2, 1), "p2p": (0.2, 1), "all_gather": (0.2, 1)}


def test_the_stderr_filter_drops_the_profiler_markers_and_nothing_else(capfd):
    marker = "USDT:2026-12-05 08:24:25 15384:15384 SyncActivityProfilerHandler.cpp:{}] {}\n"
    with native_noise_filtered():
        os.write(2, marker.format(52, "profiler_start").encode())
        os.write(2, b"kineto: an error of its own\n")
        sys.stderr.write(warnings.formatwarning("ours", UserWarning, "trainer.py", 1))
        os.write(2, marker.format(59, "profiler_stop").encode())
        os.write(2, b"USDT: a marker we do not know\n")
    err = capfd.readouterr().err
    assert "profiler_st" not in err
    assert "kineto: an error of its own" in err and "UserWarning: ours" in err
    assert "USDT: a marker we do not know" in err


def test_annotate_is_a_no_op_without_a_profiler():
    assert annotate("block 0") is comm_range("all_reduce", "tp[0,1]")


@pytest.mark.parametrize("layout", ["no traces dir", "no traces", "unreadable trace"])
def test_merge_without_readable_traces_exits_2_with_one_line(tmp_path, capsys, layout):
    if layout != "no traces dir":
        (tmp_path / "traces").mkdir()
    if layout == "unreadable trace":
        (tmp_path / "traces" / "rank_0.json.gz").write_bytes(b"not gzip")
    with pytest.raises(SystemExit) as exited:
        user_errors(merge_traces)(tmp_path)
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and str(tmp_path / "traces") in stderr


def _profiled_training(rank: int, world_size: int, dataset, out_dir: str) -> None:
    cfg = make_config(
        2, 1, 1, GPT2, dataset,
        ["train.steps=4", "observe.profile_steps=3:4", f"run.out_dir={out_dir}"],
    )  # fmt: skip
    make_trainer(cfg, world_size, dataset).run()


def _is_range(event: dict, rank: int) -> bool:
    """Whether a merged trace's event is one of rank's ranges (annotate, comm_range, a step)."""
    kind = (event.get("pid"), event.get("ph"), event.get("cat"))
    return kind == (rank, "X", "user_annotation")


def test_profiling_steps_3_to_4_of_a_tp2_run_gives_a_trace_per_rank_and_a_merged_table(
    tmp_path, dataset
):
    from tests.conftest import invoke_cli

    run_on_ranks(_profiled_training, 2, dataset, str(tmp_path), timeout=120)
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "rank_0.json.gz", "rank_1.json.gz",
    ]  # fmt: skip
    result = invoke_cli("trace", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line[:4].strip() in ("0", "1")]
    for row in rows[:2]:
        step, compute, comm_ms, bubble = (float(x) for x in row[1:5])
        assert compute + comm_ms + bubble == pytest.approx(step, rel=TRACE_PARTS_REL)
    merged = json.loads((tmp_path / "traces" / "merged.json").read_text())
    events = merged["traceEvents"] if isinstance(merged, dict) else merged
    # The two tp ranks do the same work, each traced step once: the same ranges, as many of
    # each (what one waits for the other lies in a comm range, not in its compute; how long
    # each takes is the host's load, not the trace's).
    ranges = [Counter(e["name"] for e in events if _is_range(e, rank)) for rank in (0, 1)]
    assert ranges[0] == ranges[1]
    assert ranges[0]["step 3"] == ranges[0]["step 4"] == 1
    names = {(e.get("pid"), e.get("name", "")) for e in events}
    for rank in (0, 1):
        assert (rank, "step 3") in names and (rank, "step 4") in names
        assert (rank, "comm:all_reduce:tp[0,1]") in names
        assert (rank, "block 0") in names and (rank, "loss") in names
    for rank in (0, 1):
        breakdown = step_breakdown([e for e in events if e.get("pid") == rank])
        parts = breakdown["compute"] + breakdown["comm"] + breakdown["bubble"]
        assert parts == pytest.approx(breakdown["step"], rel=TRACE_PARTS_REL)
        assert breakdown["comm"] > 0
