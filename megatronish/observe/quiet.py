"""The third-party messages we cannot fix, kept off the user's stderr, all in this one place.

Each entry names its source and matches its exact text; everything else, our own warnings
first of all, reaches stderr as it was. Nothing here silences a category or a library as a
whole. What is filtered:

- libkineto (torch.profiler's C++ side) prints `USDT:<time> <pid>:<tid>
  SyncActivityProfilerHandler.cpp:52] profiler_start` (and `profiler_stop`) on every start and
  stop of a trace. These markers are for tracing tools; there is no switch for them alone
  (KINETO_LOG_LEVEL high enough to drop them drops kineto's errors too).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

# Lines that C++ code of a library writes to file descriptor 2, matched whole (bytes).
NATIVE_NOISE = (
    re.compile(rb"USDT:[^\n]* SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)\r?\n?"),
)


def is_noise(line: bytes) -> bool:
    """Whether a line written to stderr is one of NATIVE_NOISE."""
    return any(pattern.fullmatch(line) for pattern in NATIVE_NOISE)


@contextlib.contextmanager
def native_noise_filtered() -> Iterator[None]:
    """Around a call into a library that writes NATIVE_NOISE from C++: file descriptor 2 goes to
    a temporary file meanwhile, and every line of it but the noise is written to stderr
    afterwards, in order. Where fd 2 cannot be redirected, nothing is filtered."""
    sys.stderr.flush()
    try:
        capture = tempfile.TemporaryFile()
    except OSError:
        yield
        return
    with capture:
        try:
            saved = os.dup(2)
        except OSError:
            yield
            return
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True) if not is_noise(line)]
            data = b"".join(kept)
            while data:
                data = data[os.write(2, data) :]
