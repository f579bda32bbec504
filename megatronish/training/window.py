"""The window a logged training step's time is the mean of: the steps since the last logged
one and the seconds they took, with evaluation and checkpoint saves (``paused``) left out, so
that tokens_per_s and mfu divide a window's tokens and FLOPs by the time of those same
steps."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StepWindow:
    """Steps and seconds since the last ``restart``."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def step_done(self) -> None:
        self.steps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that is not a training step (evaluation, a save): its seconds leave the
        window, its steps stay counted."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began

    def mean_step_s(self) -> float:
        """The mean seconds of a training step of the window (at least one step done)."""
        return (time.perf_counter() - self.start) / self.steps
