"""Exact context parallelism for a recurrence (linear attention): the recurrent state and the
causal convolution's tail pass between the cp ranks in the sequence's order.

Legend: cp the context-parallel degree, r this rank's index in the cp group, c = s / (2 cp)
the zigzag piece (megatronish.context.zigzag): rank r holds pieces r (A) and 2 cp - 1 - r (B).
In sequence order the pieces visit the ranks 0, 1, .., cp - 1, cp - 1, .., 1, 0, so:

- A's predecessor is rank r - 1's A (none at r = 0); B's is rank r + 1's B, or this rank's own
  A at r = cp - 1.
- The convolution's tail (the last K - 1 inputs of the predecessor) depends on the inputs only:
  one exchange, every rank at once (`neighbour_tails`); backward returns the tails' gradients
  the same way.
- The state is a result: forward it runs 0 -> 1 -> .. -> cp - 1 (A's), then, after cp - 1's B,
  cp - 1 -> .. -> 0 (B's): 2 (cp - 1) sequential hops of one state [b, heads, d_k, d_v] fp32
  each; backward the state's gradient runs the same hops in reverse (`zigzag_recurrence`).
  Backward reruns each piece's recurrence from its saved inputs and initial state (its
  internals are not kept), so that the passes stay in the same order on every rank under
  activation recompute.
Both are counted as "cp_state" (the bytes sent).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatronish.distributed import comm
from megatronish.distributed.ring import GroupRing

STATE_TAG, TAIL_TAG = 13, 14
KIND = "cp_state"


def _send(ring: GroupRing, tensor: torch.Tensor, peer: int) -> None:
    comm.start_exchange([(tensor, peer)], [], ring.group, KIND, STATE_TAG).wait()


def _recv(ring: GroupRing, like: torch.Tensor, peer: int) -> torch.Tensor:
    buffer = torch.empty_like(like)
    comm.start_exchange([], [(buffer, peer)], ring.group, KIND, STATE_TAG).wait()
    return buffer


def _pass(ring: GroupRing, result: torch.Tensor, like: torch.Tensor, outward: bool):
    """After a piece, hands its result (a state or its gradient) on: outward to rank r + 1 and
    returns what comes back from it (at r = cp - 1, result itself), the input of this rank's
    other piece; else to rank r - 1 (none at r = 0), returning None."""
    last = ring.size - 1
    if outward:
        if ring.rank == last:
            return result
        _send(ring, result.contiguous(), ring.next_rank)
        return _recv(ring, like, ring.next_rank)
    if ring.rank > 0:
        _send(ring, result.contiguous(), ring.prev_rank)
    return None


def _grads(outputs, inputs, upstream) -> list[torch.Tensor | None]:
    """The gradients of inputs (None where one needs none or does not reach the outputs)."""
    wanted = [x for x in inputs if x.requires_grad]
    found = iter(torch.autograd.grad(outputs, wanted, upstream, allow_unused=True))
    return [next(found) if x.requires_grad else None for x in inputs]


class _Recurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring, run, zero_state, count, *tensors):
        ctx.ring, ctx.run, ctx.count = ring, run, count
        state = zero_state if ring.rank == 0 else _recv(ring, zero_state, ring.prev_rank)
        initials, outputs = [], []
        for piece, inputs in enumerate((tensors[:count], tensors[count:])):
            initials.append(state)
            out, final = run(piece, *inputs, state)
            outputs.append(out)
            state = _pass(ring, final, zero_state, outward=piece == 0)
        ctx.save_for_backward(zero_state, *initials, *tensors)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        # The saved tensors first: under activation recompute, reading them reruns the forward
        # (and its passes) here, before this backward's passes, on every rank alike.
        saved = ctx.saved_tensors
        zero_state, initials, tensors = saved[0], saved[1:3], saved[3:]
        ring, count, grads = ctx.ring, ctx.count, {}
        wanted = ctx.needs_input_grad[4:]
        upstream = zero_state if ring.rank == 0 else _recv(ring, zero_state, ring.prev_rank)
        for piece in (1, 0):
            part = slice(0, count) if piece == 0 else slice(count, None)
            leaves = [x.detach().requires_grad_(w) for x, w in zip(tensors[part], wanted[part])]
            initial = initials[piece].detach().requires_grad_()
            with torch.enable_grad():  # the piece again, from its saved inputs and state
                out, final = ctx.run(piece, *leaves, initial)
            found = _grads([out, final], [*leaves, initial], [grad_outputs[piece], upstream])
            grads[piece], state_grad = found[:-1], found[-1]
            state_grad = torch.zeros_like(initial) if state_grad is None else state_grad
            upstream = _pass(ring, state_grad, zero_state, outward=piece == 1)
        return None, None, None, None, *grads[0], *grads[1]


def zigzag_recurrence(
    ring: GroupRing,
    run: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    zero_state: torch.Tensor,
    piece_a: Sequence[torch.Tensor],
    piece_b: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_a, out_b): run(piece, *inputs, initial_state) -> (out, final_state) on this rank's
    pieces A (piece 0) and B (1), each from the final state of its predecessor in sequence
    order (zero_state before the sequence's first piece), the states passed between the ranks
    (2 (cp - 1) sequential hops forward, the same backward). Gradients reach every input that
    requires them, across the ranks."""
    return _Recurrence.apply(ring, run, zero_state, len(piece_a), *piece_a, *piece_b)


class _Tails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring, tail_a, tail_b):
        ctx.ring = ring
        return _swap(ring, tail_a, tail_b, TAIL_TAG)

    @staticmethod
    def backward(ctx, grad_from_prev, grad_from_next):
        # Each gradient goes back to the rank it came from: rank r - 1's is of our B's tail.
        grad_b, grad_a = _swap(ctx.ring, grad_from_next, grad_from_prev, TAIL_TAG + 1)
        return None, grad_a, grad_b


def _swap(ring: GroupRing, to_next: torch.Tensor, to_prev: torch.Tensor, tag: int):
    """Sends to_next to rank r + 1 and to_prev to rank r - 1 (where they exist), all posted at
    once: (what rank r - 1 sent to its next, what rank r + 1 sent to its previous), zeros at
    the ends."""
    contiguous = torch.contiguous_format
    from_prev = torch.zeros_like(to_next, memory_format=contiguous)
    from_next = torch.zeros_like(to_prev, memory_format=contiguous)
    sends, recvs = [], []
    if ring.rank < ring.size - 1:
        sends.append((to_next.contiguous(), ring.next_rank))
        recvs.append((from_next, ring.next_rank))
    if ring.rank > 0:
        sends.append((to_prev.contiguous(), ring.prev_rank))
        recvs.append((from_prev, ring.prev_rank))
    comm.start_exchange(sends, recvs, ring.group, KIND, tag).wait()
    return from_prev, from_next


def neighbour_tails(
    ring: GroupRing, piece_a: torch.Tensor, piece_b: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` inputs before each piece along the last dim (pieces [..., c], c >= width):
    (tail of A: rank r - 1's A's last, zeros at r = 0; tail of B: rank r + 1's B's last, this
    rank's A's last at r = cp - 1), one exchange forward and one backward."""
    tail_a, tail_b = piece_a[..., -width:], piece_b[..., -width:]
    from_prev, from_next = _Tails.apply(ring, tail_a, tail_b)
    return from_prev, (tail_a if ring.rank == ring.size - 1 else from_next)
