"""The exceptions the CLI reports in one line: a user's mistake (exit 2), a failure while running
that the run has explained (exit 1), and a rank lost in the middle of a collective."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ReportedError(Exception):
    """An error the CLI prints as one line, `<label>: <message>`, and exits with `exit_status`,
    never with a traceback. `rank0_prints`: the run raised it on every rank after agreeing on
    it, so only global rank 0 prints it (the others exit with the same status, quietly)."""

    exit_status = 1
    label = "error"

    def __init__(self, message: str, *, rank0_prints: bool = False):
        super().__init__(message)
        self.rank0_prints = rank0_prints


class UserError(ReportedError):
    """A bad config, file, path or argument. The message names the key or file and what would
    be valid; the CLI prints it as one line and exits with status 2, never with a traceback."""

    exit_status = 2


class RunFailure(ReportedError):
    """A failure while running whose message says what happened (steps that stayed non-finite,
    another rank that failed); the CLI prints it as one line and exits with status 1."""


class Interrupted(ReportedError):
    """A run aborted by a second Ctrl-C: the CLI prints
    `aborted: <message>` and exits with status 130 (128 + SIGINT), as a shell reports it."""

    exit_status = 130
    label = "aborted"


class PeerLost(ConnectionError):
    """Another rank of the run exited in the middle of a collective this rank was waiting in."""


def read_json_object(path: Path, missing: str) -> dict[str, Any]:
    """The JSON object in file `path`; a UserError naming it when it is absent (`missing` says
    what the file should have been), not JSON, or not an object."""
    if not path.is_file():
        raise UserError(f"{path}: missing; {missing}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: must hold a JSON object")
    return data
