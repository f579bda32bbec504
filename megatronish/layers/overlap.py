"""Tensor-parallel communication under the GEMMs (parallel.tp_comm_overlap; Megatron-LM's
--tp-comm-overlap, torchtitan's async TP): each collective of a linear layer split into steps
that each run while the GEMM of one sequence chunk computes, on the ring of
megatronish.layers.tp_ring (with sequence parallelism) or as t chunked all-reduces (without);
with an fp8 recipe the GEMMs are megatronish.layers.overlap_fp8's. The schedules, what stays
exposed and where the sums change order: docs/parallelism.md (Communication under the GEMMs).

Shapes: b batch, s sequence, t tp group size, c = s / t; weights [out, in] as in nn.Linear.
Every transfer goes through megatronish.distributed.comm: a ring hop counts as "tp_ring" (the
chunk's bytes), a chunk's all-reduce as an all_reduce of the chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatronish.distributed import comm
from megatronish.fp8 import Parts, Recipe, TokenGroups
from megatronish.layers import overlap_fp8
from megatronish.layers.overlap_fp8 import _rows
from megatronish.layers.tp_ring import RingReduceScatter, TpRing, gather_chunks

Group = dist.ProcessGroup | None


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad [b, c, out]^T x [b, c, in] -> [out, in] in weight's dtype (the GEMM in grad's)."""
    return _rows(grad).t().matmul(_rows(x).to(grad.dtype)).to(weight.dtype)


class _AllGatherLinear(torch.autograd.Function):
    """x [b, c, in] -> (F.linear(all-gathered x, w_i, b_i) for each weight), decomposed."""

    @staticmethod
    def forward(ctx, x, group, keep_gathered, count, *params):
        weights, biases = params[:count], params[count:]
        ring = TpRing.of(group)
        outs = [[None] * ring.size for _ in weights]  # [weight][source]: [b, c, out / t]
        chunks = [None] * ring.size
        for source, chunk in gather_chunks(ring, x):
            for pieces, weight, bias in zip(outs, weights, biases):
                pieces[source] = F.linear(chunk, weight, bias)
            if keep_gathered:
                chunks[source] = chunk
        ctx.ring, ctx.keep_gathered, ctx.count = ring, keep_gathered, count
        ctx.has_bias = [bias is not None for bias in biases]
        ctx.save_for_backward(torch.cat(chunks, dim=1) if keep_gathered else x, *weights)
        return tuple(torch.cat(pieces, dim=1) for pieces in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *weights = ctx.saved_tensors
        ring, dtype = ctx.ring, grad_outs[0].dtype
        grads = [grad.contiguous() for grad in grad_outs]  # [b, s, out / t] each

        def input_grad(dest: int) -> torch.Tensor:  # this rank's partial of dest's block of dx
            part = None
            for grad, weight in zip(grads, weights):
                term = ring.block(grad, dest).matmul(weight.to(dtype))
                part = term if part is None else part.add_(term)
            return part

        reduce = RingReduceScatter(ring)
        if ctx.keep_gathered:  # x is the gathered input: the weight gradients in one GEMM each
            for _ in range(ring.size):
                reduce.add(input_grad(reduce.destination))
            weight_grads = [_weight_grad(g, x, w) for g, w in zip(grads, weights)]
        else:  # gather x again, chunk by chunk, under the input gradient's GEMMs
            weight_grads = [None] * len(weights)
            for source, chunk in gather_chunks(ring, x):
                reduce.add(input_grad(reduce.destination))
                for i, (grad, weight) in enumerate(zip(grads, weights)):
                    term = _weight_grad(ring.block(grad, source), chunk, weight)
                    weight_grads[i] = (
                        term if weight_grads[i] is None else weight_grads[i].add_(term)
                    )
        bias_grads = [
            _rows(grad).sum(0).to(weight.dtype) if has_bias else None
            for grad, weight, has_bias in zip(grads, weights, ctx.has_bias)
        ]
        return reduce.result, None, None, None, *weight_grads, *bias_grads


class _LinearReduceScatter(torch.autograd.Function):
    """x [b, s, in / t] -> reduce-scatter of F.linear(x, weight) along the sequence, decomposed."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ring = TpRing.of(group)
        reduce = RingReduceScatter(ring)
        for _ in range(ring.size):
            reduce.add(F.linear(ring.block(x, reduce.destination), weight))
        ctx.ring = ring
        ctx.save_for_backward(x, weight)
        return reduce.result  # [b, c, out]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ring = ctx.ring
        pieces, weight_grad = [None] * ring.size, None
        for source, chunk in gather_chunks(ring, grad):  # chunk [b, c, out]
            pieces[source] = chunk.matmul(weight.to(chunk.dtype))
            term = _weight_grad(chunk, ring.block(x, source), weight)
            weight_grad = term if weight_grad is None else weight_grad.add_(term)
        return torch.cat(pieces, dim=1), weight_grad, None


class _LinearAllReduce(torch.autograd.Function):
    """x [b, s, in / t] -> all-reduce of F.linear(x, weight), in t chunks along the sequence."""

    @staticmethod
    def forward(ctx, x, weight, group):
        pieces, works = [], []
        for chunk in x.chunk(comm.group_size(group), dim=1):
            piece = F.linear(chunk, weight)  # [b, c, out], reduced under the next chunk's GEMM
            works.append(comm.all_reduce(piece, group, async_op=True))
            pieces.append(piece)
        for work in works:
            work.wait()
        ctx.save_for_backward(x, weight)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad.matmul(weight.to(grad.dtype)), _weight_grad(grad, x, weight), None


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
    """x [b, c, in] (this rank's sequence chunk) -> F.linear(x gathered over the group's
    sequence, weight, bias) [b, s, out / t] for each weight, the gather decomposed under the
    GEMMs. Backward reduce-scatters dx. keep_gathered: save the gathered x for the weight
    gradients (else gather it again in backward, as the plain layer does). recipe: fp8 GEMMs
    (megatronish.layers.overlap_fp8), tokens the groups the tokens are split over, parts the
    logical matrices of each weight's rows (megatronish.fp8.parts)."""
    if recipe is not None:
        tokens = tokens or TokenGroups()
        return overlap_fp8.all_gather_linear(
            x, weights, biases, group, keep_gathered, recipe, tokens, parts
        )
    return _AllGatherLinear.apply(x, group, keep_gathered, len(weights), *weights, *biases)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor:
    """x [b, s, in / t] -> the sum over the group of F.linear(x, weight), this rank's sequence
    chunk [b, c, out], the reduce-scatter decomposed under the GEMMs."""
    return _LinearReduceScatter.apply(x, weight, group)


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor:
    """x [b, s, in / t] -> the sum over the group of F.linear(x, weight) [b, s, out], all-reduced
    in t chunks along the sequence, each under the next chunk's GEMM."""
    return _LinearAllReduce.apply(x, weight, group)


def reduced_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: Group,
    sequence_parallel: bool,
    recipe: Recipe | None = None,
    tokens: TokenGroups | None = None,
) -> torch.Tensor:
    """A row-parallel layer's GEMM and its reduction, decomposed: linear_reduce_scatter with
    sequence parallelism, else linear_all_reduce; with fp8 GEMMs where recipe is given
    (megatronish.layers.overlap_fp8; tokens: the groups the tokens are split over)."""
    if recipe is not None:
        tokens = tokens or TokenGroups()
        fp8 = (
            overlap_fp8.linear_reduce_scatter
            if sequence_parallel
            else overlap_fp8.linear_all_reduce
        )
        return fp8(x, weight, group, recipe, tokens)
    if sequence_parallel:
        return linear_reduce_scatter(x, weight, group)
    return linear_all_reduce(x, weight, group)
