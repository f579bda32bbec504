"""Remembering accounting results while a search asks for them again and again: plan's layout
search asks for the same layer's parameters and activations hundreds of thousands of times.

The formulas stay in their modules; ``per_config`` (or ``per_model``) wraps one of them so
that, inside ``remembering``, each result is computed once for the same config (or model
section) object, by identity (the search never changes a config it built), and the same other
arguments, by value. Outside
``remembering`` a wrapped function computes every call, so a config changed later is never
answered from an old result."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

Result = TypeVar("Result")

_tables: list[dict] = []
"""One table of results per wrapped function, filled only inside ``remembering``."""
_held: dict[int, object] = {}
"""The config objects whose identities key the tables, held so that no other takes their id."""
_active = [False]


@contextmanager
def remembering() -> Iterator[None]:
    """Within it, every ``per_config`` and ``per_model`` function remembers its results (the
    configs it is given must not change inside it); on leaving, they are forgotten."""
    outer = _active[0]
    _active[0] = True
    try:
        yield
    finally:
        _active[0] = outer
        if not outer:
            for table in _tables:
                table.clear()
            _held.clear()


def per_config(function: Callable[..., Result]) -> Callable[..., Result]:
    """function(cfg, derived, *args) (positional arguments only; `derived` a Derived or None),
    remembered inside ``remembering`` by cfg's identity, derived's value and args' values."""
    return _remembered(function, lambda cfg: cfg)


def per_model(function: Callable[..., Result]) -> Callable[..., Result]:
    """function(cfg, derived, *args) that reads of cfg its model section alone, remembered as
    ``per_config`` does by cfg.model's identity: every layout plan builds shares it."""
    return _remembered(function, lambda cfg: cfg.model)


def _remembered(
    function: Callable[..., Result], identity: Callable[[Any], object]
) -> Callable[..., Result]:
    table: dict[tuple, Any] = {}
    _tables.append(table)

    @functools.wraps(function)
    def remembered(cfg: Any, derived: object, *args: Any) -> Result:
        if not _active[0]:
            return function(cfg, derived, *args)
        config = identity(cfg)
        key = (id(config), derived, args)
        try:
            return table[key]
        except KeyError:
            _held[id(config)] = config
            value = table[key] = function(cfg, derived, *args)
            return value

    return remembered
