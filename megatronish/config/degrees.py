"""The values a message suggests for a key (``with_valid_values``): each candidate is tried by
running every check on the config with it, so a suggested value never fails another check (a
blockwise fp8 tp that does not divide the heads, an n_group that leaves one expert a group)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatronish.config.rules import VALID, DegreeError
from megatronish.config.schema import Config
from megatronish.errors import UserError


def with_value(section: Any, key: str, value: int) -> Any:
    """A config (or a section of it) with the dotted key, such as parallel.tp or
    model.moe.n_group, set to value."""
    head, _, rest = key.partition(".")
    if rest:
        value = with_value(getattr(section, head), rest, value)
    return dataclasses.replace(section, **{head: value})


def with_valid_values(exc: DegreeError, cfg: Config, checks: Callable[[Config], None]) -> UserError:
    """exc's message with the candidates of exc.key for which `checks` (every check; a
    UserError where one fails) passes in place of VALID; with none, why the simplest fails."""
    valid, first_failure = [], None
    for value in exc.candidates:
        try:
            checks(with_value(cfg, exc.key, value))
        except UserError as failure:
            first_failure = first_failure or f"at {exc.key}={value}: {failure}"
            continue
        valid.append(value)
    text = ", ".join(map(str, valid)) if valid else f"none ({first_failure})"
    return UserError(str(exc).replace(VALID, text))
