"""What this rank's collectives and point-to-point operations did, recorded as
megatronish.distributed.comm issues them (megatronish.distributed.bookkeeping.observed).

Every operation becomes an `Entry` of the flight recorder (the last `size` of them): its sequence
number on its group, the op, the group by its mesh name (tp[2,3]: the kind and the global
ranks), the tensor's shape and dtype, and its start and end times (end None while in flight).
A hang report holds them as the JSON dicts of `Entry.as_dict` (the format
`megatronish diagnose` reads).
The time this rank spent blocked in them is summed per group kind (tp, cp, dp, pp, world): the
whole call of a synchronous operation, only the wait() of an asynchronous one, so it is the
exposed wait, not the operation's span. Groups are named by ParallelState when it builds them;
an unnamed group is "world" (the default group; its point-to-point operations are the
pipeline's, "pp").
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatronish.observe.profile import comm_range

if TYPE_CHECKING:
    import torch

KINDS = ("tp", "cp", "ep", "dp", "pp", "world")
# group -> (kind, mesh name)
_NAMES: dict = {}


def name_group(group, kind: str, ranks) -> None:
    """Names group for the recorder: kind (tp, cp, dp, pp or world) and its global ranks."""
    _NAMES[group] = (kind, f"{kind}[{','.join(str(r) for r in ranks)}]")


@dataclass(slots=True)
class Entry:
    """One operation in the flight recorder. Only `end` changes once begin() has returned it.
    Shape and dtype stay as torch gives them (cheap on the hot path); as_dict() makes them
    JSON-ready."""

    seq: int  # its number among its group's operations, from 1 (0: the recorder keeps none)
    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, p2p, ...
    group: str  # the group's mesh name, tp[2,3]; "world" or "p2p" for the default group
    shape: tuple[int, ...]  # the tensor's shape (a torch.Size)
    dtype: torch.dtype
    start: float  # time.time() when it was issued
    end: float | None  # time.time() when it ended (its wait() returned); None while in flight
    kind: str  # the group kind its exposed wait counts under, one of KINDS

    def as_dict(self) -> dict:
        """The entry as a hang report holds it: seq, op, group, shape (a list), dtype (float32,
        bfloat16, ...), start, end; not kind."""
        return {
            "seq": self.seq,
            "op": self.op,
            "group": self.group,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "start": self.start,
            "end": self.end,
        }


class Recorder:
    """The flight recorder and wait totals of this process (one, `RECORDER`)."""

    def __init__(self, size: int = 2000):
        self.lock = threading.Lock()
        self.resize(size)

    def resize(self, size: int) -> None:
        """Keeps the last `size` operations from now on (0: none); clears the record."""
        with self.lock:
            self.size = size
            self.entries: deque = deque(maxlen=max(size, 1))
            self.seq: dict[str, int] = defaultdict(int)
        self.reset_waits()

    def reset_waits(self) -> None:
        self.waits = dict.fromkeys(KINDS, 0.0)

    def begin(self, op: str, group, tensor: torch.Tensor) -> Entry:
        """The entry of an operation on tensor over group starting now (recorded unless the
        recorder keeps none)."""
        if op == "p2p" and group not in _NAMES:  # the pipeline's, on the default group
            kind, name = "pp", "p2p"
        else:
            kind, name = _NAMES.get(group, ("world", "world"))
        entry = Entry(0, op, name, tensor.shape, tensor.dtype, time.time(), None, kind)
        if self.size:
            with self.lock:
                self.seq[name] += 1
                entry.seq = self.seq[name]
                self.entries.append(entry)
        return entry

    def end(self, entry: Entry, waited_since: float) -> None:
        """Marks entry done now; waited_since (a time.time()) starts this rank's exposed wait."""
        now = time.time()
        entry.end = now
        self.waits[entry.kind] += now - waited_since

    def snapshot(self) -> list[dict]:
        """The recorded entries, oldest first, as JSON-ready dicts (Entry.as_dict)."""
        with self.lock:
            entries = list(self.entries) if self.size else []
        return [entry.as_dict() for entry in entries]

    def oldest_in_flight(self) -> Entry | None:
        """The oldest entry that has not ended, or None. It is the live entry: read it, do not
        change it (its end may be set meanwhile; the other fields stay)."""
        with self.lock:
            for entry in self.entries:
                if entry.end is None:
                    return entry
        return None


RECORDER = Recorder()


class Timed:
    """An asynchronous operation's handle whose wait() ends its recorder entry; the time in
    wait() is this rank's exposed wait."""

    def __init__(self, work, entry: Entry):
        self.work, self.entry, self.done = work, entry, False

    def wait(self) -> bool:
        if self.done:
            return True
        start = time.time()
        if self.work is not None:
            with comm_range(self.entry.op, self.entry.group):
                self.work.wait()
        self.done = True
        RECORDER.end(self.entry, start)
        return True
