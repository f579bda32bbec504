"""`megatronish diagnose RUN_DIR`: reads the ranks' hang reports (<RUN_DIR>/debug/rank_R.json,
written by megatronish.observe.flight) and names the rank the others wait for.

A collective hangs on group G at sequence number N when some ranks are in flight in G's N-th
operation and a member of G (from its mesh name, tp[2,3]) never entered it: its last
operation on G is below N, it has none on G, or it wrote no dump. When several groups hang,
the report is the one whose missing ranks are not themselves waiting in another collective
(a rank waiting for a waiting rank only passes the hang on), the earliest of those to start.
Point-to-point operations have no member list; they are reported only when no collective
explains the hang.

The dumps are not one instant: each rank writes its own within a poll of the request, so a rank
that had just entered a collective may name one that was computing a moment before or after.
A verdict therefore needs time: a member counts as missing only when its dump, or the waiter's
own if it is later, shows the waiter had already waited more than STUCK_AFTER_S without it; an
operation in flight no longer than that is no hang. A dump of a healthy run finds no rank stuck.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megatronish.errors import UserError

_KEYS = ("rank", "pid", "reason", "time", "entries", "in_flight", "stacks")
_ENTRY_KEYS = ("seq", "op", "group", "start", "end")
_STACK_LINES = 8
STUCK_AFTER_S = 1.0  # longer than a dump request takes to reach every rank (a poll, 0.5 s)


@dataclass
class _Hang:
    group: str
    seq: int
    op: str
    waiters: list[int]
    missing: list[int]  # members that never entered it
    start: float  # when the first waiter entered it
    waited: float  # the longest a waiter had been in it when it dumped


def diagnose_run(run_dir: str | Path) -> tuple[str, int]:
    """The verdict on run_dir's dumps and the exit status: 0, or 2 with a one-line error when
    there are no dumps or one is not a valid dump."""
    try:
        dumps = load_dumps(Path(run_dir))
    except UserError as e:
        return f"error: {e}", UserError.exit_status
    return verdict(dumps), 0


def load_dumps(run_dir: Path) -> dict[int, dict]:
    """Every rank's dump in run_dir/debug, by rank; a UserError naming the path when there is
    none or one is not valid."""
    debug = run_dir / "debug"
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if not debug.is_dir():
        raise UserError(f"{debug}: no such directory (ranks dump there on a hang or SIGUSR2)")
    paths = sorted(debug.glob("rank_*.json"))
    if not paths:
        raise UserError(f"{debug}: no hang reports (rank_*.json) there")
    dumps = {}
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
        problem = _invalid(report)
        if problem:
            raise UserError(f"{path}: not a hang report ({problem})")
        dumps[report["rank"]] = report
    return dumps


def _invalid(report) -> str | None:
    """What is wrong with a parsed dump, or None."""
    if not isinstance(report, dict):
        return "not an object"
    missing = [k for k in _KEYS if k not in report]
    if missing:
        return f"no {missing[0]!r}"
    if not isinstance(report["rank"], int) or not isinstance(report["time"], (int, float)):
        return "rank or time is not a number"
    if not isinstance(report["entries"], list) or not isinstance(report["stacks"], list):
        return "entries or stacks is not a list"
    if not all(isinstance(s, dict) for s in report["stacks"]):
        return "a stack is not an object"
    for entry in report["entries"]:
        if not isinstance(entry, dict) or any(k not in entry for k in _ENTRY_KEYS):
            return f"an entry lacks one of {', '.join(_ENTRY_KEYS)}"
        types = (
            (entry["seq"], int),
            (entry["start"], (int, float)),
            (entry["group"], str),
            (entry["op"], str),
        )
        if not all(isinstance(value, t) for value, t in types):
            return f"an entry's seq, start, group or op has the wrong type: {entry}"
    return None


def rank_list(ranks) -> str:
    """The ranks sorted, runs of consecutive ranks compressed: "rank 3", "ranks 0-2, 5"."""
    ranks = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _members(group: str, world_size: int | None) -> list[int] | None:
    """The global ranks of a group from its mesh name; None when it has no member list."""
    if group == "world":
        return list(range(world_size)) if world_size else None
    match = re.fullmatch(r"\w+\[([\d,]+)\]", group)
    return [int(r) for r in match.group(1).split(",")] if match else None


def _is_p2p(entry: dict) -> bool:
    return entry["op"] == "p2p" or entry["group"] == "p2p"


def _verb(ranks: list[int], one: str, many: str) -> str:
    return f"{rank_list(ranks)} {one if len(set(ranks)) == 1 else many}"


def _stack(report: dict) -> list[str]:
    """The last lines of the main thread's stack in report, indented."""
    if not report["stacks"]:
        return ["    (no stack recorded)"]
    lines = str(report["stacks"][0].get("stack", "")).rstrip("\n").splitlines()
    return ["    " + line for line in lines[-_STACK_LINES:]]


def _stuck(dumps: dict[int, dict], rank: int, entry: dict) -> bool:
    """Whether `entry`, in flight on `rank`, had been for more than STUCK_AFTER_S at its dump."""
    return entry["end"] is None and dumps[rank]["time"] - entry["start"] > STUCK_AFTER_S


def _last_seqs(dumps: dict[int, dict]) -> dict[tuple[int, str], int]:
    """(rank, group) -> the highest sequence number the rank recorded on the group."""
    last_seq: dict[tuple[int, str], int] = {}
    for rank, report in dumps.items():
        for entry in report["entries"]:
            if not _is_p2p(entry):
                key = (rank, entry["group"])
                last_seq[key] = max(last_seq.get(key, 0), entry["seq"])
    return last_seq


def _absent_too_long(dumps: dict[int, dict], member: int, flights: list[tuple[int, dict]]) -> bool:
    """Whether `member`, which had not entered the collective of `flights`, is known to have
    kept one of its waiters there more than STUCK_AFTER_S: until the member's dump or the
    waiter's, whichever is earlier. A member that wrote no dump, or only one older than the
    waiter's by more than STUCK_AFTER_S (it did not answer that request), counts as absent until
    the waiter's."""
    for rank, entry in flights:
        waiter_at = dumps[rank]["time"]
        seen_at = dumps[member]["time"] if member in dumps else waiter_at
        if seen_at < waiter_at - STUCK_AFTER_S:
            seen_at = waiter_at
        if min(waiter_at, seen_at) - entry["start"] > STUCK_AFTER_S:
            return True
    return False


def _hangs(dumps: dict[int, dict], world_size: int | None) -> list[_Hang]:
    """Per group, the first collective stuck in flight that a member never entered (for longer
    than STUCK_AFTER_S)."""
    last_seq = _last_seqs(dumps)
    waiting: dict[str, dict[int, list[tuple[int, dict]]]] = {}  # group -> seq -> (rank, entry)
    for rank, report in dumps.items():
        for entry in report["entries"]:
            if not _is_p2p(entry) and _stuck(dumps, rank, entry):
                by_seq = waiting.setdefault(entry["group"], {})
                by_seq.setdefault(entry["seq"], []).append((rank, entry))
    hangs = []
    for group, by_seq in waiting.items():
        members = _members(group, world_size)
        if members is None:
            continue
        for seq in sorted(by_seq):
            flights = by_seq[seq]
            missing = [
                m
                for m in members
                if (m not in dumps or last_seq.get((m, group), 0) < seq)
                and _absent_too_long(dumps, m, flights)
            ]
            if missing:
                start = min(e["start"] for _, e in flights)
                waited = max(dumps[r]["time"] - e["start"] for r, e in flights)
                waiters, op = [r for r, _ in flights], flights[0][1]["op"]
                hangs.append(_Hang(group, seq, op, waiters, missing, start, waited))
                break
    return hangs


def _describe(hang: _Hang, dumps: dict[int, dict]) -> list[str]:
    where = f"{hang.op} #{hang.seq} on {hang.group}"
    waited = f"in flight {hang.waited:.1f} s"
    absent = [r for r in hang.missing if r not in dumps]
    present = [r for r in hang.missing if r in dumps]
    one = len(absent) == 1
    gone = f"{rank_list(absent)} wrote no dump ({'it' if one else 'they'} may have exited)"
    if not present:
        waiters = _verb(hang.waiters, "waits", "wait")
        return [f"{gone}; {waiters} for {'it' if one else 'them'} in {where} ({waited})"]
    line = f"{rank_list(present)} never entered {where}; "
    line += f"{_verb(hang.waiters, 'waits', 'wait')} there ({waited})"
    if absent:
        line += f"; {gone}"
    return [f"{line}; rank {present[0]}'s stack:", *_stack(dumps[present[0]])]


def _entered_by_all(
    entry: dict,
    dumps: dict[int, dict],
    world_size: int | None,
    last_seq: dict[tuple[int, str], int],
) -> bool:
    """Whether every member of entry's collective had entered it; True for point-to-point and
    for a group without a member list (nothing says otherwise)."""
    members = None if _is_p2p(entry) else _members(entry["group"], world_size)
    if members is None:
        return True
    return all(m in dumps and last_seq.get((m, entry["group"]), 0) >= entry["seq"] for m in members)


def _no_missing_rank(dumps: dict[int, dict], world_size: int | None) -> list[str] | None:
    """The oldest operation stuck in flight that no member is missing from (no collective
    misses a rank); None when there is none."""
    last_seq = _last_seqs(dumps)
    flights = [
        (e["start"], r, e)
        for r, d in dumps.items()
        for e in d["entries"]
        if _stuck(dumps, r, e) and _entered_by_all(e, dumps, world_size, last_seq)
    ]
    if not flights:
        return None
    _, rank, oldest = min(flights, key=lambda f: (f[0], f[1]))
    waited = dumps[rank]["time"] - oldest["start"]
    if _is_p2p(oldest):
        waiters = sorted({r for _, r, e in flights if _is_p2p(e)})
        head = f"{_verb(waiters, 'waits', 'wait')} in point-to-point {oldest['op']} "
        head += (
            f"(in flight {waited:.1f} s; the peer is not recorded) and no collective misses a rank"
        )
    else:
        same = (oldest["group"], oldest["seq"])
        waiters = sorted({r for _, r, e in flights if (e["group"], e["seq"]) == same})
        head = f"no rank is missing from {oldest['op']} #{oldest['seq']} on {oldest['group']}: "
        head += f"{_verb(waiters, 'waits', 'wait')} there (in flight {waited:.1f} s)"
    return [f"{head}; rank {rank}'s stack:", *_stack(dumps[rank])]


def verdict(dumps: dict[int, dict]) -> str:
    """The hang report of dumps (by rank), as text: which rank the others wait for, where, and
    its stack; or that no rank was stuck (no collective waited longer than STUCK_AFTER_S for a
    rank seen outside it), or inside a collective at all."""
    sizes = [d["world_size"] for d in dumps.values() if isinstance(d.get("world_size"), int)]
    world_size = max(sizes) if sizes else None
    hangs = _hangs(dumps, world_size)
    if hangs:
        in_flight = {r for r, d in dumps.items() for e in d["entries"] if e["end"] is None}
        roots = [h for h in hangs if any(m not in dumps or m not in in_flight for m in h.missing)]
        root = min(roots or hangs, key=lambda h: h.start)
        lines = _describe(root, dumps)
        others = [h for h in hangs if h is not root]
        if others:
            names = ", ".join(f"{h.op} #{h.seq} on {h.group}" for h in others)
            noun = "group hangs" if len(others) == 1 else "groups hang"
            lines.append(f"({len(others)} other {noun} too: {names})")
        return "\n".join(lines)
    stuck = _no_missing_rank(dumps, world_size)
    if stuck is not None:
        return "\n".join(stuck)
    if any(e["end"] is None for d in dumps.values() for e in d["entries"]):
        text = "no rank is stuck: no collective had waited longer than "
        text += f"{STUCK_AFTER_S:g} s for a rank seen outside it when the ranks dumped "
    else:
        text = "no hang: no rank was inside a collective when the dumps were taken "
    text += f"({len(dumps)} dumps: {rank_list(dumps)})"
    absent = [r for r in range(world_size or 0) if r not in dumps]
    if absent:
        text += f"; no dump from {rank_list(absent)}"
    return text
