"""Tensor-parallel communication under the GEMMs (parallel.tp_comm_overlap; Megatron-LM's
--tp-comm-overlap, torchtitan's async TP): each collective of a linear layer split into steps
that each run while the GEMM of one sequence chunk computes, on the ring of
megatronish.layers.tp_ring (with sequence parallelism) or as t chunked all-reduces (without).
Each schedule is written once; its GEMMs and what its ring carries come from the layer's
numeric format (megatronish.layers.formats). The schedules, what stays exposed and where the
sums change order: docs/parallelism.md (Communication under the GEMMs); with fp8: docs/fp8.md.

Shapes: b batch, s sequence, t tp group size, c = s / t; weights [out, in] as in nn.Linear.
Every transfer goes through megatronish.distributed.comm: a ring hop counts as "tp_ring" (the
chunk's bytes), a chunk's all-reduce as an all_reduce of the chunk. A weight that needs no
gradient (LoRA's frozen base) gets none: no weight-gradient GEMM, and nothing kept or gathered
again for one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatronish.distributed import comm
from megatronish.fp8 import Parts, Recipe, Split, TokenGroups
from megatronish.layers.formats import rows, seq_block
from megatronish.layers.plan import numeric_format
from megatronish.layers.tp_ring import RingReduceScatter, TpRing, gather_chunks

Group = dist.ProcessGroup | None


def _summed(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    return term if total is None else total.add_(term)


class _AllGatherLinear(torch.autograd.Function):
    """x [b, c, in] -> (x all-gathered times w_i, + b_i, for each weight), decomposed. Weights
    that need no gradient (LoRA's frozen base) get none; where none needs one, nothing is kept
    or gathered again for the weight gradients."""

    @staticmethod
    def forward(ctx, x, group, keep_gathered, fmt, split, count, *params):
        weights, biases = params[:count], params[count:]
        ring = TpRing.of(group)
        x_op, w_ops, ctx.states = fmt.operands(x, weights, split, gathered=True)
        outs = [[None] * ring.size for _ in weights]  # [weight][source]: [b, c, out / t]
        sent = fmt.send(x_op, x, keep_gathered)
        kept = [None] * ring.size  # what arrived, kept for backward
        for source, arrived in gather_chunks(ring, sent):
            mine = source == ring.rank
            chunk = x_op if mine else fmt.received(arrived, x_op, split, keep_gathered)
            for pieces, w_op, bias in zip(outs, w_ops, biases):
                pieces[source] = fmt.chunk_linear(chunk, w_op, bias, split, x)
            if keep_gathered or mine:
                kept[source] = arrived
        ctx.ring, ctx.format, ctx.split, ctx.keep_gathered = ring, fmt, split, keep_gathered
        ctx.weights = weights  # themselves (not a recompute's copies): the keys of their casts
        ctx.has_bias = [bias is not None for bias in biases]
        ctx.weight_grads = [weight.requires_grad for weight in weights]
        if any(ctx.weight_grads):
            saved = torch.cat(kept, dim=1) if keep_gathered else fmt.again(kept[ring.rank], x)
            ctx.save_for_backward(saved)
        return tuple(torch.cat(pieces, dim=1) for pieces in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        ring, fmt, split, weights = ctx.ring, ctx.format, ctx.split, ctx.weights
        grads = [grad.contiguous() for grad in grad_outs]  # [b, s, out / t] each
        casts = fmt.grad_operands(grads, weights, split, ctx.states)
        reduce = RingReduceScatter(ring)

        def reduce_next() -> None:  # this rank's partial of the next block of dx
            reduce.add(fmt.grad_block(casts, reduce.destination, ring.size, grads[0]))

        weight_grads = [None] * len(weights)
        if not any(ctx.weight_grads):
            for _ in range(ring.size):
                reduce_next()
        else:
            weight_grads = _gathered_weight_grads(ctx, grads, casts, reduce_next)
        bias_grads = [
            rows(grad).sum(0).to(weight.dtype) if has_bias else None
            for grad, weight, has_bias in zip(grads, weights, ctx.has_bias)
        ]
        return reduce.result, None, None, None, None, None, *weight_grads, *bias_grads


def _gathered_weight_grads(ctx, grads: list, casts, reduce_next) -> list:
    """_AllGatherLinear's weight gradients (None for a weight that needs none), each block of
    dx reduced by reduce_next under them: on the kept gathered input, or on x gathered again
    chunk by chunk under the dx GEMMs."""
    (saved,), ring, fmt, split = ctx.saved_tensors, ctx.ring, ctx.format, ctx.split
    needed = zip(grads, ctx.weights, ctx.weight_grads)
    wanted = [(i, grad, weight) for i, (grad, weight, need) in enumerate(needed) if need]
    weight_grads, gathered = [None] * len(grads), saved
    if ctx.keep_gathered:
        for _ in range(ring.size):
            reduce_next()
    else:
        chunks = [None] * ring.size
        for source, chunk in gather_chunks(ring, saved):
            reduce_next()
            if not fmt.chunked_weight_grad:
                chunks[source] = chunk
                continue
            for i, grad, weight in wanted:
                part = rows(seq_block(grad, source, ring.size))
                term = fmt.grad_weight(part, rows(chunk), weight, split, None)
                weight_grads[i] = _summed(weight_grads[i], term)
        gathered = None if fmt.chunked_weight_grad else torch.cat(chunks, dim=1)
    if gathered is not None:  # one GEMM a weight, on the gathered input
        for i, grad, weight in wanted:
            weight_grads[i] = fmt.grad_weight_of(grad, gathered, weight, split, casts[i])
    return weight_grads


class _LinearReduceScatter(torch.autograd.Function):
    """x [b, s, in / t] -> reduce-scatter of x weight^T along the sequence, decomposed."""

    @staticmethod
    def forward(ctx, x, weight, group, fmt, split):
        ring = TpRing.of(group)
        x_op, (w_op,), ctx.states = fmt.operands(x, [weight], split, gathered=False)
        reduce = RingReduceScatter(ring)
        for _ in range(ring.size):
            block = fmt.block(x_op, reduce.destination, ring.size, x)
            reduce.add(fmt.chunk_linear(block, w_op, None, split, x))
        ctx.ring, ctx.format, ctx.split, ctx.weight = ring, fmt, split, weight
        ctx.save_for_backward(x if weight.requires_grad else None)
        return reduce.result  # [b, c, out]

    @staticmethod
    def backward(ctx, grad):
        (x,), weight, ring = ctx.saved_tensors, ctx.weight, ctx.ring
        fmt, split = ctx.format, ctx.split
        # this rank's chunk, with the whole gathered gradient's tensorwise scale
        casts = fmt.grad_operands([grad], [weight], split, ctx.states, gathered=True)
        pieces, chunks, weight_grad = [None] * ring.size, [None] * ring.size, None
        for source, chunk in gather_chunks(ring, grad):  # chunk [b, c, out]
            mine = casts if source == ring.rank else fmt.grad_received(chunk, casts, split)
            pieces[source] = fmt.grad_block(mine, 0, 1, grad)
            if x is None:  # a weight without gradient (LoRA's frozen base)
                continue
            if fmt.chunked_weight_grad:
                x_part = rows(seq_block(x, source, ring.size))
                term = fmt.grad_weight(rows(chunk), x_part, weight, split, None)
                weight_grad = _summed(weight_grad, term)
            else:
                chunks[source] = chunk
        if x is not None and not fmt.chunked_weight_grad:
            full = rows(torch.cat(chunks, dim=1))
            weight_grad = fmt.grad_weight(full, rows(x), weight, split, casts[0][2])
        return torch.cat(pieces, dim=1), weight_grad, None, None, None


class _LinearAllReduce(torch.autograd.Function):
    """x [b, s, in / t] -> all-reduce of x weight^T, in t chunks along the sequence."""

    @staticmethod
    def forward(ctx, x, weight, group, fmt, split):
        parts = comm.group_size(group)
        x_op, (w_op,), ctx.states = fmt.operands(x, [weight], split, gathered=False)
        pieces, works = [], []
        for index in range(parts):
            block = fmt.block(x_op, index, parts, x)
            piece = fmt.chunk_linear(block, w_op, None, split, x)  # reduced under the next GEMM
            works.append(comm.all_reduce(piece, group, async_op=True))
            pieces.append(piece)
        for work in works:
            work.wait()
        ctx.format, ctx.split, ctx.weight = fmt, split, weight
        ctx.save_for_backward(x if weight.requires_grad else None)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,), weight, fmt, split = ctx.saved_tensors, ctx.weight, ctx.format, ctx.split
        grad_in, state = fmt.grad_input(grad, weight, split, ctx.states[0])
        if x is None:  # a weight without gradient (LoRA's frozen base)
            return grad_in, None, None, None, None
        weight_grad = fmt.grad_weight(rows(grad), rows(x), weight, split, state)
        return grad_in, weight_grad, None, None, None


def all_gather_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: Group,
    keep_gathered: bool = False,
    recipe: Recipe | None = None,
    tokens: TokenGroups | None = None,
    parts: Parts | None = None,
) -> tuple[torch.Tensor, ...]:
    """x [b, c, in] (this rank's sequence chunk) -> x gathered over the group's sequence times
    each weight, + its bias, [b, s, out / t] each, the gather decomposed under the GEMMs.
    Backward reduce-scatters dx. keep_gathered: keep what the ring gathered for the weight
    gradients (else gather it again in backward, as the plain layer does). recipe: the numeric
    format's fp8 recipe (None: the autocast precision), tokens the groups the tokens are split
    over, parts the logical matrices of each weight's rows (megatronish.fp8.parts)."""
    split = Split(group, "out", tokens or TokenGroups(), parts)
    args = (x, group, keep_gathered, numeric_format(recipe), split, len(weights))
    return _AllGatherLinear.apply(*args, *weights, *biases)


def reduced_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Group,
    sequence_parallel: bool,
    recipe: Recipe | None = None,
    tokens: TokenGroups | None = None,
) -> torch.Tensor:
    """A row-parallel layer's GEMM x [b, s, in / t] times weight [out, in / t]^T and its sum
    over the group, decomposed: with sequence parallelism reduce-scattered on the ring (this
    rank's chunk [b, c, out]), else all-reduced in t chunks along the sequence ([b, s, out]),
    each under the next chunk's GEMM; recipe and tokens as in all_gather_linear."""
    split = Split(group, "in", tokens or TokenGroups())
    schedule = _LinearReduceScatter if sequence_parallel else _LinearAllReduce
    return schedule.apply(x, weight, group, numeric_format(recipe), split)
