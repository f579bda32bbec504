"""The helpers every config check uses: `require` (a UserError naming the key unless a
condition holds), `divisors`, and `require_degree`, whose message lists the values of a key that
pass every check (config.degrees fills them in)."""

from __future__ import annotations

from collections.abc import Iterable

from megatronish.errors import UserError

VALID = "{valid}"
"""Where a DegreeError's message takes the values that pass every check."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


class DegreeError(UserError):
    """A value of `key` (a dotted config key, such as parallel.tp) that fails a check; its
    message holds VALID where config.degrees puts the `candidates` that pass every check."""

    def __init__(self, message: str, key: str, candidates: Iterable[int]):
        super().__init__(message)
        self.key, self.candidates = key, list(candidates)


def require_degree(cond: bool, message: str, key: str, candidates: Iterable[int]) -> None:
    """`require` for a value of `key` whose message lists the valid ones at VALID (candidates:
    the values to try, such as the divisors a split needs)."""
    if not cond:
        raise DegreeError(message, key, candidates)
