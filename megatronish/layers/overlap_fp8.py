"""The decomposed GEMMs of megatronish.layers.overlap with fp8 operands: the same ring steps,
each chunk's GEMM an fp8 GEMM of megatronish.fp8.gemm whose operands carry exactly the scales
of the layer without the decomposition, so the two differ only by the order of fp32 additions.
Where the scales come from and what each ring carries: docs/fp8.md (With the tp communication
under the GEMMs).

Shapes: b batch, s sequence, t tp group size, c = s / t; weights [out, in]; a chunk's rows are
its b * c tokens, batch-major.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatronish.distributed import comm
from megatronish.fp8 import Parts, Recipe, Split, TokenGroups
from megatronish.fp8.gemm import (
    Scales,
    add_bias,
    forward_casts,
    forward_product,
    grad_input_casts,
    grad_weight_gemm,
    product,
    summed_product,
    tensorwise,
)
from megatronish.fp8.quantize import Cast, Quantized, quantize
from megatronish.layers.tp_ring import RingReduceScatter, TpRing, gather_chunks

Group = dist.ProcessGroup | None
TP = frozenset({"tp"})


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [rows, n]."""
    return x.reshape(-1, x.shape[-1])


def _seq(t: torch.Tensor, batch: int) -> torch.Tensor:
    """t [b * c, n] as [b, c, n]."""
    return t.view(batch, -1, t.shape[-1])


def _block(q: Quantized, batch: int, index: int, parts: int) -> Quantized:
    """Sequence chunk `index` of `parts` of q (rows [b * s], batch-major): [b * c, K]."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        seq = t.view(batch, -1, t.shape[-1])
        c = seq.shape[1] // parts
        return _rows(seq[:, index * c : (index + 1) * c])

    scale = q.scale if q.operand.granularity == "tensor" else rows(q.scale)
    return Quantized(rows(q.payload), scale, q.operand)


def pack(q: Quantized, batch: int) -> torch.Tensor:
    """A chunk's fp8 cast as bytes to send, [b, c, K + 4 n]: each token's payload, then its n
    float32 scales (none for a tensorwise cast)."""
    payload = q.payload.view(torch.uint8).view(batch, -1, q.payload.shape[-1])
    if q.operand.granularity == "tensor":
        return payload
    scale = q.scale.contiguous().view(torch.uint8).view(batch, payload.shape[1], -1)
    return torch.cat([payload, scale], dim=-1)


def unpack(packed: torch.Tensor, like: Quantized) -> Quantized:
    """The cast `pack` sent, as `like` (this rank's chunk) is laid out."""
    k = like.payload.shape[-1]
    payload = _rows(packed[..., :k]).view(like.payload.dtype)
    if like.operand.granularity == "tensor":
        return Quantized(payload, like.scale, like.operand)
    scale = _rows(packed[..., k:].contiguous()).view(torch.float32)
    return Quantized(payload, scale, like.operand)


def ring_carries_cast(recipe: Recipe, keep_gathered: bool) -> bool:
    """Whether all_gather_linear's forward ring carries the input's fp8 cast (else the input
    itself, each rank casting each chunk as it arrives): a tensorwise cast always; a per-token
    one unless the gathered input is kept for the weight gradient, whose per-feature scales need
    the input (one gather of it rather than the cast forward and the input again backward)."""
    return recipe.input.granularity == "tensor" or not keep_gathered


class _AllGatherLinear(torch.autograd.Function):
    """x [b, c, in] -> (fp8 linear of the all-gathered x with w_i, + b_i, for each weight)."""

    @staticmethod
    def forward(ctx, x, group, keep_gathered, recipe, split, count, *params):
        weights, biases = params[:count], params[count:]
        ring, batch = TpRing.of(group), x.shape[0]
        qx, qws = forward_casts(_rows(x), list(weights), recipe, split, split.cp | TP)
        outs = [[None] * ring.size for _ in weights]  # [weight][source]: [b, c, out / t]
        tensor = recipe.input.granularity == "tensor"
        send_cast = ring_carries_cast(recipe, keep_gathered)  # else x itself, kept for dW
        kept = [None] * ring.size  # what backward keeps of each chunk
        for source, arrived in gather_chunks(ring, pack(qx, batch) if send_cast else x):
            if source == ring.rank:
                chunk = qx
            elif send_cast:
                chunk = unpack(arrived, qx)
            else:  # per-token scales: the chunk's cast is the whole tensor's
                cast = Cast(_rows(arrived), recipe.input)
                (chunk,) = quantize([cast], recipe.power_of_2_scales, split, recipe.backend)
            for pieces, qw, bias in zip(outs, qws, biases):
                out = _seq(forward_product(chunk, qw, split, recipe, x.dtype), batch)
                pieces[source] = add_bias(out, bias)
            kept[source] = _seq(chunk.payload.view(torch.uint8), batch) if tensor else arrived
        ctx.ring, ctx.recipe, ctx.split, ctx.count = ring, recipe, split, count
        ctx.weights = weights  # themselves (not a recompute's copies): the keys of their casts
        ctx.scales = [Scales(input=tensorwise(qx), weight=tensorwise(qw[0])) for qw in qws]
        ctx.has_bias = [bias is not None for bias in biases]
        ctx.kept = keep_gathered
        if keep_gathered:  # the gathered fp8 payload (tensorwise) or x [b, s, in]
            ctx.save_for_backward(torch.cat(kept, dim=1))
        elif tensor:
            ctx.save_for_backward(kept[ring.rank])  # [b, c, in] fp8 bytes, gathered again
        else:
            ctx.save_for_backward(x)  # gathered again in its own precision for dW
        return tuple(torch.cat(pieces, dim=1) for pieces in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        (saved,), ring, recipe, split = ctx.saved_tensors, ctx.ring, ctx.recipe, ctx.split
        grads = [_rows(grad) for grad in grad_outs]  # [b * s, out / t] each
        batch, dtype = grad_outs[0].shape[0], grad_outs[0].dtype
        casts = [
            grad_input_casts(grad, weight, recipe, split, scales)
            for grad, weight, scales in zip(grads, ctx.weights, ctx.scales)
        ]

        def input_grad(dest: int) -> torch.Tensor:  # this rank's partial of dest's block of dx
            blocks = [_block(qdy, batch, dest, ring.size) for qdys, _, _ in casts for qdy in qdys]
            qwts = [qwt for _, weight_casts, _ in casts for qwt in weight_casts]
            return _seq(summed_product(blocks, qwts, dtype, recipe.backend), batch)

        reduce = RingReduceScatter(ring)
        if ctx.kept:
            gathered = saved
            for _ in range(ring.size):
                reduce.add(input_grad(reduce.destination))
        else:  # gather x (or its fp8 payload) again, chunk by chunk, under the dx GEMMs
            chunks = [None] * ring.size
            for source, chunk in gather_chunks(ring, saved):
                reduce.add(input_grad(reduce.destination))
                chunks[source] = chunk
            gathered = torch.cat(chunks, dim=1)
        weight_grads = []
        for grad, weight, (_, _, scales) in zip(grads, ctx.weights, casts):
            if recipe.input.granularity == "tensor":
                payload = _rows(gathered).view(recipe.input.dtype).t()  # [in, T], as X.t()
                x_t = Quantized(payload, scales.input, recipe.input)
                dw = grad_weight_gemm(grad, None, recipe, split, scales, x_t=x_t)
            else:
                dw = grad_weight_gemm(grad, _rows(gathered), recipe, split, scales)
            weight_grads.append(dw.to(weight.dtype))
        bias_grads = [
            grad.sum(0).to(weight.dtype) if has_bias else None
            for grad, weight, has_bias in zip(grads, ctx.weights, ctx.has_bias)
        ]
        return reduce.result, None, None, None, None, None, *weight_grads, *bias_grads


class _LinearReduceScatter(torch.autograd.Function):
    """x [b, s, in / t] -> reduce-scatter along the sequence of the fp8 linear of x, decomposed."""

    @staticmethod
    def forward(ctx, x, weight, group, recipe, tokens):
        ring, batch = TpRing.of(group), x.shape[0]
        split = Split(group, "in", tokens)
        qx, ((qw,),) = forward_casts(_rows(x), [weight], recipe, split)
        reduce = RingReduceScatter(ring)
        for _ in range(ring.size):
            block = _block(qx, batch, reduce.destination, ring.size)
            reduce.add(_seq(product(block, qw, x.dtype, recipe.backend), batch))
        ctx.ring, ctx.recipe, ctx.split, ctx.weight = ring, recipe, split, weight
        ctx.scales = Scales(input=tensorwise(qx), weight=tensorwise(qw))
        ctx.save_for_backward(x)
        return reduce.result  # [b, c, out]

    @staticmethod
    def backward(ctx, grad):
        (x,), weight, ring = ctx.saved_tensors, ctx.weight, ctx.ring
        recipe, split = ctx.recipe, ctx.split
        batch, dtype = grad.shape[0], grad.dtype
        # this rank's chunk, with the whole gathered gradient's tensorwise scale
        (mine,), (qwt,), scales = grad_input_casts(
            _rows(grad), weight, recipe, split, ctx.scales, split.cp | TP
        )
        pieces, chunks = [None] * ring.size, [None] * ring.size
        for source, chunk in gather_chunks(ring, grad):  # chunk [b, c, out]
            if source == ring.rank:
                qdy = mine
            else:
                cast = Cast(_rows(chunk), recipe.grad_output, scale=scales.grad_output)
                (qdy,) = quantize([cast], recipe.power_of_2_scales, split, recipe.backend)
            pieces[source] = _seq(product(qdy, qwt, dtype, recipe.backend), batch)
            chunks[source] = chunk
        full = _rows(torch.cat(chunks, dim=1))
        weight_grad = grad_weight_gemm(full, _rows(x), recipe, split, scales)
        return torch.cat(pieces, dim=1), weight_grad.to(weight.dtype), None, None, None


class _LinearAllReduce(torch.autograd.Function):
    """x [b, s, in / t] -> all-reduce of the fp8 linear of x, in t chunks along the sequence."""

    @staticmethod
    def forward(ctx, x, weight, group, recipe, tokens):
        parts, batch = comm.group_size(group), x.shape[0]
        split = Split(group, "in", tokens)
        qx, ((qw,),) = forward_casts(_rows(x), [weight], recipe, split)
        pieces, works = [], []
        for index in range(parts):
            block = _block(qx, batch, index, parts)
            piece = _seq(product(block, qw, x.dtype, recipe.backend), batch)
            works.append(comm.all_reduce(piece, group, async_op=True))
            pieces.append(piece)
        for work in works:
            work.wait()
        ctx.recipe, ctx.split, ctx.weight = recipe, split, weight
        ctx.scales = Scales(input=tensorwise(qx), weight=tensorwise(qw))
        ctx.save_for_backward(x)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):
        (x,), weight, recipe, split = ctx.saved_tensors, ctx.weight, ctx.recipe, ctx.split
        (qdy,), (qwt,), scales = grad_input_casts(_rows(grad), weight, recipe, split, ctx.scales)
        grad_in = product(qdy, qwt, grad.dtype, recipe.backend).view(*x.shape)
        weight_grad = grad_weight_gemm(_rows(grad), _rows(x), recipe, split, scales)
        return grad_in, weight_grad.to(weight.dtype), None, None, None


def all_gather_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    group: Group,
    keep_gathered: bool,
    recipe: Recipe,
    tokens: TokenGroups,
    parts: Parts | None = None,
) -> tuple[torch.Tensor, ...]:
    """overlap.all_gather_linear with fp8 GEMMs (module doc): x [b, c, in] -> [b, s, out / t]
    for each weight; parts: the logical matrices of each weight's rows (megatronish.fp8.parts)."""
    args = (x, group, keep_gathered, recipe, Split(group, "out", tokens, parts), len(weights))
    return _AllGatherLinear.apply(*args, *weights, *biases)


def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, group: Group, recipe: Recipe, tokens: TokenGroups
) -> torch.Tensor:
    """overlap.linear_reduce_scatter with fp8 GEMMs: x [b, s, in / t] -> [b, c, out]."""
    return _LinearReduceScatter.apply(x, weight, group, recipe, tokens)


def linear_all_reduce(
    x: torch.Tensor, weight: torch.Tensor, group: Group, recipe: Recipe, tokens: TokenGroups
) -> torch.Tensor:
    """overlap.linear_all_reduce with fp8 GEMMs: x [b, s, in / t] -> [b, s, out]."""
    return _LinearAllReduce.apply(x, weight, group, recipe, tokens)
