"""What this rank's collectives and point-to-point operations did, recorded by
megatronish.distributed.comm.

Every operation becomes an entry of the flight recorder (the last `size` of them): its sequence
number on its group, the op, the group by its mesh name (tp[2,3]: the kind and the global
ranks), the tensor's shape and dtype, and its start and end times (end None while in flight).
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

from megatronish.observe.profile import comm_range

KINDS = ("tp", "cp", "ep", "dp", "pp", "world")
# group -> (kind, mesh name)
_NAMES: dict = {}


def name_group(group, kind: str, ranks) -> None:
    """Names group for the recorder: kind (tp, cp, dp, pp or world) and its global ranks."""
    _NAMES[group] = (kind, f"{kind}[{','.join(str(r) for r in ranks)}]")


def forget_groups() -> None:
    _NAMES.clear()


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

    def begin(self, op: str, group, tensor) -> list:
        """An entry for an operation starting now: [seq, op, group name, shape, dtype, start,
        end, kind]."""
        if op == "p2p" and group not in _NAMES:  # the pipeline's, on the default group
            kind, name = "pp", "p2p"
        else:
            kind, name = _NAMES.get(group, ("world", "world"))
        entry = [0, op, name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                 time.time(), None, kind]  # fmt: skip
        if self.size:
            with self.lock:
                self.seq[name] += 1
                entry[0] = self.seq[name]
                self.entries.append(entry)
        return entry

    def end(self, entry: list, waited_since: float) -> None:
        """Marks entry done now; waited_since (a time.time()) starts this rank's exposed wait."""
        now = time.time()
        entry[6] = now
        self.waits[entry[7]] += now - waited_since

    def snapshot(self) -> list[dict]:
        """The recorded entries, oldest first, as JSON-ready dicts."""
        with self.lock:
            entries = [list(e) for e in self.entries] if self.size else []
        keys = ("seq", "op", "group", "shape", "dtype", "start", "end")
        return [dict(zip(keys, e[:7])) for e in entries]

    def oldest_in_flight(self) -> list | None:
        """The oldest entry that has not ended, or None."""
        with self.lock:
            for entry in self.entries:
                if entry[6] is None:
                    return list(entry)
        return None


RECORDER = Recorder()


class Timed:
    """An asynchronous operation's handle whose wait() ends its recorder entry; the time in
    wait() is this rank's exposed wait."""

    def __init__(self, work, entry: list):
        self.work, self.entry, self.done = work, entry, False

    def wait(self) -> bool:
        if self.done:
            return True
        start = time.time()
        if self.work is not None:
            with comm_range(self.entry[1], self.entry[2]):
                self.work.wait()
        self.done = True
        RECORDER.end(self.entry, start)
        return True
