"""The interleaved 1F1B schedule's order of operations, as pure functions of (pp, v, m, rank);
megatronish.pipeline.runner runs it.

Interleaved (parallel.pp_virtual = v > 1; Narayanan et al. 2021, Megatron-LM's
forward_backward_pipelining_with_interleaving): the layers are cut into p v model chunks and
rank r holds chunks r, r + p, ...; chunk c sends its output to chunk c + 1 on rank (r + 1) mod p
(the last rank back to rank 0 for the next round). A rank runs its forwards in groups of p
micro-batches through one chunk after another, its backwards likewise with the chunks in
reverse (so each chunk sees its micro-batches in order); 1f1b runs warmup_forwards of them,
then one forward and one backward in turn, then the rest of the backwards; gpipe every forward
first. m must be a multiple of p. Each forward or backward of a (micro-batch, chunk) pair is
1 / v of a stage's, so the bubble is (p - 1) / (v m), for v times the point-to-point messages.
Every rank's operations are placed on a common clock (interleaved_ticks: each at the first
tick after its input was produced, one per rank and tick), and every message is sent and
received at its producer's tick: each rank posts its sends and receives in tick order, so
between any two ranks they pair up in the same order (with pp = 2 both directions of both
kinds go between the same two ranks), and a receive is waited for only when its operation
needs it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

Op = tuple[str, int, int]
"""An operation of the interleaved schedule: ("F" forward | "B" backward, micro-batch, global
model chunk). As a message key: ("F", i, c) is chunk c's input for micro-batch i, ("B", i, c)
the gradient of chunk c's output."""


@dataclass(frozen=True)
class Tick:
    """What one pipeline rank does at tick `at` of the interleaved schedule: at most one
    operation, whose output goes to pp rank `send` (None: it sends nothing), then receives of
    what its neighbours' operations of this tick produced for it, (key, their pp rank)."""

    at: int
    op: Op | None
    send: int | None
    recvs: tuple[tuple[Op, int], ...]


def warmup_forwards(pp: int, virtual: int, m: int, pp_rank: int, schedule: str = "1f1b") -> int:
    """The (micro-batch, chunk) forwards pp rank pp_rank runs before its first backward under
    the interleaved schedule (Megatron's count): every one of the m v under gpipe or when
    m = pp, else min(2 (pp - pp_rank - 1) + (v - 1) pp, m v). The most it holds at once is one
    more (all m v at most)."""
    total = m * virtual
    if schedule == "gpipe" or m == pp:
        return total
    return min(2 * (pp - pp_rank - 1) + (virtual - 1) * pp, total)


def chunk_order(pp: int, virtual: int, m: int, pp_rank: int, backward: bool) -> list[Op]:
    """Rank pp_rank's forwards (or backwards) in schedule order: groups of pp micro-batches
    through its chunks in turn (in reverse for backward), group after group."""
    kind, ops = ("B" if backward else "F"), []
    for index in range(m * virtual):
        group, within = divmod(index, pp * virtual)
        local = within // pp
        if backward:
            local = virtual - 1 - local
        ops.append((kind, group * pp + within % pp, pp_rank + local * pp))
    return ops


def rank_order(
    pp: int, virtual: int, m: int, pp_rank: int, schedule: str, forward_only: bool
) -> list[Op]:
    """Every operation of rank pp_rank in the order it runs them."""
    forwards = chunk_order(pp, virtual, m, pp_rank, backward=False)
    if forward_only:
        return forwards
    backwards = chunk_order(pp, virtual, m, pp_rank, backward=True)
    warmup = warmup_forwards(pp, virtual, m, pp_rank, schedule)
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup :]


def _needs(op: Op, chunks: int) -> list[Op]:
    """The operations whose results op reads: the previous chunk's forward (forward), this
    chunk's forward and the next chunk's backward (backward)."""
    kind, micro, chunk = op
    if kind == "F":
        return [("F", micro, chunk - 1)] if chunk > 0 else []
    return [("F", micro, chunk)] + ([("B", micro, chunk + 1)] if chunk < chunks - 1 else [])


def _message(op: Op, pp: int, chunks: int) -> tuple[Op, int] | None:
    """(key, receiving pp rank) of what op sends: a forward's output to the next chunk, a
    backward's input gradient to the previous chunk; None for the ends of the model."""
    kind, micro, chunk = op
    if kind == "F" and chunk < chunks - 1:
        return ("F", micro, chunk + 1), (chunk + 1) % pp
    if kind == "B" and chunk > 0:
        return ("B", micro, chunk - 1), (chunk - 1) % pp
    return None


@functools.lru_cache(maxsize=32)
def interleaved_ticks(
    pp: int, virtual: int, m: int, schedule: str, forward_only: bool
) -> tuple[tuple[Tick, ...], ...]:
    """Per pp rank, its ticks that do something, in order. Each rank's operations
    (rank_order) go on a common clock in its order, each at the first tick after every result
    it reads was produced (at most one operation per rank and tick); what an operation sends
    is received at the same tick. m must be a multiple of pp; raises RuntimeError if the
    orders wait on each other."""
    if m % pp:
        raise ValueError(
            f"the interleaved schedule needs a multiple of {pp=} micro-batches, not {m}"
        )
    chunks = pp * virtual
    orders = [rank_order(pp, virtual, m, r, schedule, forward_only) for r in range(pp)]
    done: dict[Op, int] = {}
    ticks: list[list[Tick]] = [[] for _ in range(pp)]
    position, tick = [0] * pp, 0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        ran: dict[int, Op] = {}
        for r in range(pp):
            if position[r] < len(orders[r]):
                op = orders[r][position[r]]
                if all(done.get(need, tick) < tick for need in _needs(op, chunks)):
                    ran[r] = op
        if not ran:
            raise RuntimeError(f"the interleaved schedule of {m} micro-batches stalls at {pp=}")
        sends: dict[int, int] = {}
        recvs: list[list[tuple[Op, int]]] = [[] for _ in range(pp)]
        for r, op in ran.items():
            done[op], position[r] = tick, position[r] + 1
            message = _message(op, pp, chunks)
            if message is not None:
                key, to = message
                sends[r] = to
                recvs[to].append((key, r))
        for r in range(pp):
            if r in ran or recvs[r]:
                ticks[r].append(Tick(tick, ran.get(r), sends.get(r), tuple(recvs[r])))
        tick += 1
    return tuple(tuple(rank_ticks) for rank_ticks in ticks)
