"""The one exception type for a user's mistake: the CLI prints its message on one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class UserError(Exception):
    """A bad config, file, path or argument. The message names the key or file and what would
    be valid; the CLI prints it as one line and exits with status 2, never with a traceback."""


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
