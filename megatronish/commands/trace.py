"""`megatronish trace`: the ranks' profiler traces (megatronish.observe.profile) merged into one
Chrome/Perfetto trace, and where each rank's traced step time went.

A rank's step time (its "step N" ranges) splits into exposed communication (its "comm:<op>:..."
ranges other than point-to-point), bubble (its "comm:p2p:..." ranges: pipeline stages waiting
for their neighbours) and compute (the rest). Each is a union of intervals, clipped to the step
ranges, so nested or overlapping ranges count once and bubble time is never also counted as
communication: the three add up to the step time. Ranges on every thread count, since a CUDA
backward runs on the autograd engine's thread while the thread that called it waits.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import defaultdict
from pathlib import Path

from megatronish.errors import UserError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "cp_ring")
_STEP = re.compile(r"step (\d+)")
_RANK_FILE = re.compile(r"rank_(\d+)\.json\.gz")
# Metadata each rank's trace names its processes with; the merged trace names one per rank.
_PROCESS_METADATA = {"process_name", "process_labels", "process_sort_index"}


def merge_traces(run_dir: str | Path, output: str | Path | None = None) -> tuple[str, int]:
    """Merges <run_dir>/traces/rank_R.json.gz into output (<run_dir>/traces/merged.json by
    default), replacing it atomically, with each rank as process R ("rank R"). Returns the text
    to print (where it was written, the per-rank time table and the per-kind collective table)
    and the exit status, 0. A missing or unreadable trace raises a UserError naming the file.

    Timestamps: traces recorded on one host keep their own times (torch's "ts", microseconds
    from each file's baseTimeNanoseconds, brought onto one clock), so the skew between ranks
    shows: a rank that reaches a collective late, and the ranks that wait for it. Traces from
    several hosts, whose clocks need not agree, are shifted so that every rank's first traced
    step starts when the lowest rank's does."""
    directory = Path(run_dir) / "traces"
    if not directory.is_dir():
        raise UserError(f"{directory} does not exist; train with observe.profile_steps set first")
    files = sorted(
        (int(m.group(1)), path)
        for path in directory.iterdir()
        if (m := _RANK_FILE.fullmatch(path.name))
    )
    if not files:
        raise UserError(f"{directory}: no rank_R.json.gz traces")
    traces = {rank: _read(path) for rank, path in files}
    _align(traces)
    merged = []
    for rank, trace in traces.items():
        merged += _rank_events(rank, max(traces) + 1, trace["traceEvents"])
    out = Path(output) if output else directory / "merged.json"
    if not out.parent.is_dir():
        raise UserError(f"{out}: its directory does not exist")
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
    os.replace(tmp, out)
    times = {rank: step_breakdown(trace["traceEvents"]) for rank, trace in traces.items()}
    lines = [f"wrote {out} ({len(traces)} ranks)", "", *_time_table(times), "", *_kind_table(times)]
    return "\n".join(lines), 0


def _read(path: Path) -> dict:
    """The Chrome trace in gzipped JSON file path; a UserError naming it when it cannot be read."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as file:
            trace = json.load(file)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a gzipped JSON trace ({exc})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise UserError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def _align(traces: dict[int, dict]) -> None:
    """Brings every trace's "ts" onto one clock in place (see merge_traces)."""
    hosts = {trace.get("host_name") for trace in traces.values()}
    if len(hosts) == 1:
        bases = {rank: int(trace.get("baseTimeNanoseconds", 0)) for rank, trace in traces.items()}
        lowest = min(bases.values())
        shifts = {rank: (base - lowest) / 1000 for rank, base in bases.items()}
    else:
        starts = {rank: _first_step_start(trace["traceEvents"]) for rank, trace in traces.items()}
        reference = next((start for start in starts.values() if start is not None), 0.0)
        shifts = {rank: 0.0 if s is None else reference - s for rank, s in starts.items()}
    for rank, trace in traces.items():
        if shifts[rank]:
            for event in trace["traceEvents"]:
                if isinstance(event.get("ts"), (int, float)):
                    event["ts"] += shifts[rank]


def _first_step_start(events: list) -> float | None:
    """The start of the trace's lowest-numbered "step N" range; None without one."""
    steps = [e for e in _ranges(events) if _STEP.fullmatch(e["name"])]
    if not steps:
        return None
    return min(steps, key=lambda e: (int(e["name"].split()[1]), e["ts"]))["ts"]


def _rank_events(rank: int, ranks: int, events: list) -> list[dict]:
    """events as process `rank` of the merged trace: its own name and sort index, and flow ids
    made unique among ranks 0 to ranks - 1."""
    names = {"process_name": {"name": f"rank {rank}"}, "process_sort_index": {"sort_index": rank}}
    out = [
        {"ph": "M", "name": name, "pid": rank, "tid": 0, "args": args}
        for name, args in names.items()
    ]
    for event in events:
        if not isinstance(event, dict):
            continue
        if event.get("ph") == "M" and event.get("name") in _PROCESS_METADATA:
            continue
        event = dict(event, pid=rank)
        if isinstance(event.get("id"), int):
            event["id"] = event["id"] * ranks + rank
        out.append(event)
    return out


# ---- where the step time went


def _ranges(events: list) -> list[dict]:
    """The record_function ranges of a trace's CPU side (not their copies on CUDA streams)."""
    return [
        e
        for e in events
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and isinstance(e.get("name"), str)
        and isinstance(e.get("ts"), (int, float))
        and isinstance(e.get("dur"), (int, float))
    ]


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _intersect(a: list, b: list) -> list[tuple[float, float]]:
    """The intersection of two unions (sorted, disjoint intervals)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list, b: list) -> list[tuple[float, float]]:
    """a less b, both unions."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def _length(intervals: list) -> float:
    return sum(end - start for start, end in intervals)


def step_breakdown(events: list) -> dict:
    """One rank's traced time in ms, summed over its traced steps: "step", "comm" (exposed
    communication), "bubble" and "compute" (step - comm - bubble); "kinds": {op: (ms inside the
    steps, ranges)} for each collective kind with a range in the steps, a range nested in
    another of its kind counted once; and "steps", the numbers of the traced steps."""
    ranges = _ranges(events)
    step_ranges = [e for e in ranges if _STEP.fullmatch(e["name"])]
    steps = _union((e["ts"], e["ts"] + e["dur"]) for e in step_ranges)
    by_kind = defaultdict(list)
    for event in ranges:
        parts = event["name"].split(":", 2)
        span = (event["ts"], event["ts"] + event["dur"])
        if parts[0] == "comm" and len(parts) == 3 and _intersect([span], steps):
            by_kind[parts[1]].append(span)
    bubble = _intersect(_union(by_kind.get("p2p", [])), steps)
    others = [span for kind, spans in by_kind.items() if kind != "p2p" for span in spans]
    comm = _subtract(_intersect(_union(others), steps), bubble)
    step_ms, comm_ms, bubble_ms = _length(steps) / 1e3, _length(comm) / 1e3, _length(bubble) / 1e3
    kinds = {
        kind: (_length(_intersect(_union(spans), steps)) / 1e3, _outermost(spans))
        for kind, spans in by_kind.items()
    }
    return {
        "step": step_ms,
        "comm": comm_ms,
        "bubble": bubble_ms,
        "compute": step_ms - comm_ms - bubble_ms,
        "kinds": kinds,
        "steps": sorted({int(_STEP.fullmatch(e["name"])[1]) for e in step_ranges}),
    }


def _outermost(spans: list) -> int:
    """How many of spans lie inside no other one."""
    count, end = 0, float("-inf")
    for _, stop in sorted(spans, key=lambda s: (s[0], -s[1])):
        if stop > end:
            count, end = count + 1, stop
    return count


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _step_numbers(steps: list[int]) -> str:
    """Steps as "3 to 5" when consecutive, else as "3, 5, 9"."""
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]} to {steps[-1]}"
    return ", ".join(str(step) for step in steps)


def _time_table(times: dict[int, dict]) -> list[str]:
    traced = sorted({step for t in times.values() for step in t["steps"]})
    caption = (
        f"ms per rank, summed over the {len(traced)} traced steps ({_step_numbers(traced)}); "
        "shares of that sum; the last column per step"
    )
    head = (
        f"{'rank':>4} {'traced ms':>10} {'compute ms':>11} {'comm ms':>10} {'bubble ms':>10} "
        f"{'compute':>8} {'comm':>7} {'bubble':>7} {'ms per step':>12}"
    )
    lines = [caption, head]
    for rank, t in times.items():
        per_step = f"{t['step'] / len(t['steps']):.2f}" if t["steps"] else "-"
        lines.append(
            f"{rank:>4} {t['step']:>10.2f} {t['compute']:>11.2f} {t['comm']:>10.2f} "
            f"{t['bubble']:>10.2f} {_percent(t['compute'], t['step']):>8} "
            f"{_percent(t['comm'], t['step']):>7} {_percent(t['bubble'], t['step']):>7} "
            f"{per_step:>12}"
        )
    return lines


def _kind_table(times: dict[int, dict]) -> list[str]:
    seen = {kind for t in times.values() for kind in t["kinds"]}
    kinds = [*KINDS, *sorted(seen - set(KINDS))]
    width = max(len(kind) for kind in kinds) + 2
    lines = ["collectives per rank: ms summed over the traced steps (number of ranges)"]
    lines.append(f"{'rank':>4}" + "".join(f"{kind:>{width}}" for kind in kinds))
    for rank, t in times.items():
        cells = []
        for kind in kinds:
            ms, count = t["kinds"].get(kind, (0.0, 0))
            cells.append(f"{f'{ms:.2f} ({count})':>{width}}")
        lines.append(f"{rank:>4}" + "".join(cells))
    return lines
