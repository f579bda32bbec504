"""The three GEMMs of a linear layer with fp8 operands, emulated: each operand is cast to fp8
by the recipe, dequantized to float32, and the product is an fp32 matmul (fp32 accumulation),
cast to the dtype of its first operand, as torchao's Float8Linear(emulate=True) computes it.
Where the recipe's backend runs the fp8 kernels the casts and products run there instead
(megatronish.fp8.kernels), with the same numerics.

Shapes: T tokens (all leading dims of the input flattened), in and out the features of this
rank's weight [out, in]. `split` says which dim of the weight is split over the tp group (a
column-parallel layer's "out", a row-parallel layer's "in"): the input [T, in] is split with
it on "in", the output gradient [T, out] on "out"; under context parallelism the T tokens are
split over split.tokens (see megatronish.fp8.quantize). A tensorwise
scale is computed once per tensor: the input's and the weight's in the forward, the output
gradient's in the input-gradient GEMM, and reused by the later GEMMs (``Scales``).

The weight's casts (its scales, their amax all-reduce and its fp8 payload, for the forward and
for the input gradient) are taken once and kept until ``weights_changed`` (the trainer's step runs
inside ``weights_fixed``) or an in-place change autograd sees: a step's micro-batches, and a
full recompute's rerun, share them. The numerics are those of casting the weight every time.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from megatronish.fp8 import kernels
from megatronish.fp8.parts import along_k, along_rows, splitting
from megatronish.fp8.quantize import Axes, Cast, Quantized, Split, quantize
from megatronish.fp8.recipes import Recipe


@dataclass(frozen=True)
class Scales:
    """The tensorwise scales known so far (None: not tensorwise, or not computed yet)."""

    input: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None


def tensorwise(q: Quantized) -> torch.Tensor | None:
    """q's scale where it is one scale for the whole tensor, else None."""
    return q.scale if q.operand.granularity == "tensor" else None


def product(a: Quantized, b: Quantized, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """A [M, K] B [N, K]^T of the dequantized operands in float32 (whatever autocast says),
    as dtype: on the fp8 kernels where `backend` runs them (megatronish.fp8.kernels)."""
    if kernels.fused(backend, a.payload):
        return kernels.product(a.payload, a.scale, b.payload, b.scale, b.operand, dtype)
    with torch.autocast(a.payload.device.type, enabled=False):
        return torch.mm(a.values(), b.values().t()).to(dtype)


_WEIGHT_CASTS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
"""weight -> {(use, recipe, backend): (the weight's version, its cast)}, while the weight lives."""


def add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out + bias in out's dtype (an fp8 GEMM's output is in its input's dtype)."""
    return out if bias is None else out + bias.to(out.dtype)


def weights_changed() -> None:
    """Forgets every weight's kept casts: the weights may have changed (the optimizer updates
    them outside autograd's version count)."""
    _WEIGHT_CASTS.clear()


@contextmanager
def weights_fixed():
    """The weights stay as they are inside (one training step's micro-batches): the casts kept
    before are forgotten on entry (a restore, a load may have changed them) and on exit (the
    optimizer's update)."""
    weights_changed()
    try:
        yield
    finally:
        weights_changed()


def kept_casts(
    casts: list[Cast],
    weights: list[tuple[torch.Tensor, list[Cast]]],
    use: str,
    recipe: Recipe,
    split: Split,
) -> tuple[list[Quantized], list[list[Quantized]]]:
    """(quantize(casts), each weight's casts for `use`): one quantize call (one amax all-reduce)
    for the casts and the weights' casts that are not in their weight's cache (the module doc:
    casts are kept while the weight holds the version they were taken of). A weight's casts: its
    own (or its transpose's), or each expert's of a stacked expert weight."""
    key = (use, recipe.name, recipe.backend)
    kept, caches = [], [_WEIGHT_CASTS.setdefault(weight, {}) for weight, _ in weights]
    for (weight, _), cache in zip(weights, caches):
        version, made = cache.get(key, (None, None))
        kept.append(made if version == weight._version else None)
    missing = [i for i, made in enumerate(kept) if made is None]
    out = quantize(
        [*casts, *(cast for i in missing for cast in weights[i][1])],
        recipe.power_of_2_scales,
        split,
        recipe.backend,
    )
    start = len(casts)
    for i in missing:
        made = out[start : start + len(weights[i][1])]
        start += len(made)
        caches[i][key] = (weights[i][0]._version, made)
        kept[i] = made
    return out[: len(casts)], kept


def forward_casts(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    recipe: Recipe,
    split: Split,
    tokens: Axes | None = None,
) -> tuple[Quantized, list[list[Quantized]]]:
    """The forward GEMM's operands in fp8: X [T, in] and each weight [out, in] (the weights
    share X: llama's gate and up), a weight as one cast per logical matrix of its rows where
    its blocks would straddle them (blockwise, split.parts: megatronish.fp8.parts; else one;
    forward_product puts the outputs together). tokens: the axes X's rows are split over
    (default split.cp; a sequence chunk of a gathered input adds tp: its tensorwise scale is
    the gathered tensor's, all-reduced with the weights' amaxes)."""
    rows = split.cp if tokens is None else tokens
    parts = splitting(split.parts, recipe.weight.granularity, rows=True)
    out, inner = split.tp("out"), split.tp("in")
    (qx,), qws = kept_casts(
        [Cast(x, recipe.input, rows=rows, k=inner)],
        [(w, [Cast(p, recipe.weight, out, inner) for p in along_rows(w, parts)]) for w in weights],
        "forward",
        recipe,
        split,
    )
    return qx, qws


def forward_product(
    qx: Quantized, qws: list[Quantized], split: Split, recipe: Recipe, dtype: torch.dtype
) -> torch.Tensor:
    """Y [T, out] = X W^T from forward_casts' casts of X and of one weight: one GEMM, or one per
    logical matrix, each into its rows' columns of Y."""
    if len(qws) == 1:
        return product(qx, qws[0], dtype, recipe.backend)
    out_rows = sum(qw.payload.shape[0] for qw in qws)
    out = qx.payload.new_empty((qx.payload.shape[0], out_rows), dtype=dtype)
    for index, qw in zip(split.parts.index(out_rows, out.device), qws):
        out[:, index] = product(qx, qw, dtype, recipe.backend)
    return out


def grad_input_casts(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    recipe: Recipe,
    split: Split,
    scales: Scales,
    tokens: Axes | None = None,
) -> tuple[list[Quantized], list[Quantized], Scales]:
    """The input-gradient GEMM's operands in fp8, dY [T, out] and W^T [in, out], each as one
    cast per logical matrix of the output rows (split.parts) where their scales run across them
    (rowwise; blockwise where a tile would straddle two: megatronish.fp8.parts), else one each
    (the GEMM is the sum of the pairs' products: summed_product), and the scales with the
    output gradient's. tokens: as in forward_casts (a sequence chunk of a gathered output
    gradient: its tensorwise scale is the gathered tensor's)."""
    rows = split.cp if tokens is None else tokens
    parts = splitting(split.parts, recipe.grad_output.granularity)
    weight_casts = [
        Cast(wt, recipe.weight, rows=split.tp("in"), k=split.tp("out"), scale=scales.weight)
        for wt in along_k(weight.t(), parts)
    ]
    qdys, (qwts,) = kept_casts(
        [
            Cast(dy, recipe.grad_output, rows=rows, k=split.tp("out"))
            for dy in along_k(grad_output, parts)
        ],
        [(weight, weight_casts)],
        "input gradient",
        recipe,
        split,
    )
    return qdys, qwts, replace(scales, grad_output=tensorwise(qdys[0]))


def summed_product(
    qas: list[Quantized], qbs: list[Quantized], dtype: torch.dtype, backend: str
) -> torch.Tensor:
    """The sum of product(a, b) over the pairs (one GEMM per logical matrix, as grad_input_casts
    gives them), added in dtype as separate layers' input gradients are."""
    out = product(qas[0], qbs[0], dtype, backend)
    for qa, qb in zip(qas[1:], qbs[1:]):
        out = out.add_(product(qa, qb, dtype, backend))
    return out


def forward_gemm(
    x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, split: Split
) -> tuple[torch.Tensor, Scales]:
    """Y [T, out] = X [T, in] W^T, and the tensorwise scales it computed."""
    qx, (qws,) = forward_casts(x, [weight], recipe, split)
    out = forward_product(qx, qws, split, recipe, x.dtype)
    return out, Scales(input=tensorwise(qx), weight=tensorwise(qws[0]))


def grad_input_gemm(
    grad_output: torch.Tensor, weight: torch.Tensor, recipe: Recipe, split: Split, scales: Scales
) -> tuple[torch.Tensor, Scales]:
    """dX [T, in] = dY [T, out] W (this rank's partial sum for a column-parallel layer), and the
    scales with the output gradient's."""
    qdys, qwts, scales = grad_input_casts(grad_output, weight, recipe, split, scales)
    return summed_product(qdys, qwts, grad_output.dtype, recipe.backend), scales


def grad_weight_gemm(
    grad_output: torch.Tensor,
    x: torch.Tensor | None,
    recipe: Recipe,
    split: Split,
    scales: Scales,
    x_t: Quantized | None = None,
) -> torch.Tensor:
    """dW [out, in] = dY^T [out, T] X [T, in], in the output gradient's dtype. x_t: X^T [in, T]
    already cast (tensorwise: the forward cast's payload transposed, the same numbers as
    casting X^T with the forward's scale); x is then not read."""
    dy_t = Cast(
        grad_output.t(),
        recipe.grad_output,
        rows=split.tp("out"),
        k=split.cp,
        scale=scales.grad_output,
    )
    if x_t is not None:
        (qdyt,) = quantize([dy_t], recipe.power_of_2_scales, split, recipe.backend)
        return product(qdyt, x_t, grad_output.dtype, recipe.backend)
    qdyt, qxt = quantize(
        [dy_t, Cast(x.t(), recipe.input, rows=split.tp("in"), k=split.cp, scale=scales.input)],
        recipe.power_of_2_scales,
        split,
        recipe.backend,
    )
    return product(qdyt, qxt, grad_output.dtype, recipe.backend)


class _Fp8Linear(torch.autograd.Function):
    """x W^T with the three GEMMs in fp8; saves x and the weight in their own precision. A
    weight that needs no gradient (LoRA's frozen base) gets none: no weight-gradient GEMM, x
    not kept for it."""

    @staticmethod
    def forward(ctx, x, weight, recipe, split):
        x2d = x.reshape(-1, x.shape[-1])
        out, scales = forward_gemm(x2d, weight, recipe, split)
        ctx.weight_grad = weight.requires_grad
        if ctx.weight_grad:
            ctx.save_for_backward(x)
        ctx.weight = weight  # itself (not a recompute's copy): the key of its kept casts
        ctx.recipe, ctx.split, ctx.scales = recipe, split, scales
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        weight, recipe, split = ctx.weight, ctx.recipe, ctx.split
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_in, scales = grad_input_gemm(dy, weight, recipe, split, ctx.scales)
        grad_in = grad_in.view(*grad_out.shape[:-1], grad_in.shape[-1])
        if not ctx.weight_grad:
            return grad_in, None, None, None
        (x,) = ctx.saved_tensors
        grad_weight = grad_weight_gemm(dy, x.reshape(-1, x.shape[-1]), recipe, split, scales)
        return grad_in, grad_weight.to(weight.dtype), None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, split: Split) -> torch.Tensor:
    """x [..., in] times this rank's weight [out, in]^T -> [..., out] in x's dtype, no bias and
    no communication beyond the scales' amax all-reduces (forward and backward)."""
    return _Fp8Linear.apply(x, weight, recipe, split)
