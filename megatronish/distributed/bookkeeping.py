"""What every collective pays besides moving its bytes, in one place (``observed``, which each
collective of megatronish.distributed.comm calls once): its bytes counted in every active
``CommCounter``, its entry in the flight recorder (megatronish.observe.record: its sequence number
on its group, start and end, and the time this rank waited in it) and, while profiling, a range
named after it (megatronish.observe.profile.comm_range).

A ``CommCounter`` used as a context manager records, for each collective issued inside it, the
payload size and the bytes this rank sends under the ring algorithm NCCL and gloo use for large
messages: all-reduce 2 (n-1)/n x payload, all-gather and reduce-scatter (n-1)/n x the full
tensor, broadcast and reduce (n-1)/n x payload. Tests and the benchmark compare these counts
with the analytic formula.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatronish.observe.profile import comm_range
from megatronish.observe.record import RECORDER, Timed

_ACTIVE: list[CommCounter] = []


@dataclass
class CommCounter:
    """Bytes and calls per collective kind while active (``with CommCounter() as c:``)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payload_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def __enter__(self) -> CommCounter:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def record(self, kind: str, payload: int, sent: float, calls: int = 1) -> None:
        """Counts `calls` operations of `kind` moving payload bytes, of which this rank sent
        `sent`."""
        self.calls[kind] += calls
        self.payload_bytes[kind] += payload
        self.sent_bytes[kind] += sent

    @property
    def total_sent(self) -> float:
        return sum(self.sent_bytes.values())


class Done:
    """The work handle of a collective that has already completed."""

    def wait(self) -> bool:
        return True


def observed(
    op: str,
    group: dist.ProcessGroup | None,
    tensor: torch.Tensor,
    payload: int,
    sent: float,
    start: Callable[[bool], Any],
    async_op: bool = False,
    calls: int = 1,
) -> Timed | None:
    """Runs start(async_op), which issues the collective `op` on tensor over group, counted as
    `calls` operations (none counted when 0) of payload bytes of which this rank sends `sent`.
    Synchronously, the whole call is its flight-recorder span and this rank's wait, and None is
    returned; asynchronously, the returned handle's wait() closes the span and is the wait
    (start may return None for a collective it finished at once). The counts are taken before
    the collective is issued, so a collective that fails is counted too."""
    if calls:
        for counter in _ACTIVE:
            counter.record(op, payload, sent, calls)
    entry = RECORDER.begin(op, group, tensor)
    with comm_range(op, entry.group):
        work = start(async_op)
    if async_op:
        return Timed(work or Done(), entry)
    RECORDER.end(entry, entry.start)
    return None
