"""The two helpers every config check uses: `require` (a UserError naming the key unless a
condition holds) and `divisors` (the valid degrees a message lists)."""

from __future__ import annotations

from megatronish.errors import UserError


def require(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (the valid degrees a message lists)."""
    return [d for d in range(1, n + 1) if n % d == 0]
