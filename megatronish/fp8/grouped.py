"""The three GEMMs of a layer of experts with fp8 operands (an MoE layer's grouped GEMMs): for
each expert, those of a linear layer (megatronish.fp8.gemm) on its rows, with the scales the
one-process run takes whatever the layout.

Shapes: R rows, expert-major (megatronish.moe.dispatch): E_l local experts, each a contiguous
run of rows made of S runs, one per source rank in rank order (that rank's micro-batch's rows
for the expert, in the micro-batch's order); counts [E_l][S] their sizes. weight [E_l, out, in]:
expert e's weight[e] is a linear layer's [out, in], `split` naming its dim split over tp (gate
and up: "out", down: "in", as megatronish.moe.experts splits them).

Scales. One process runs one micro-batch at a time, so each expert's fp8 GEMMs there see that
micro-batch's rows of the expert, and its gradients are summed over the micro-batches. At
ep > 1 an expert's rows come from S micro-batches (one per source rank), at cp > 1 a micro-
batch's tokens are split over the cp ranks; so a scale whose group runs over tokens groups the
rows of one (expert, source) run, its amax all-reduced over the ranks that split that
micro-batch's tokens (cp: Split.tokens) and over tp where its K is split, and a weight's scales
are its own expert's (over tp where the expert's weight is split):

    tensorwise  one scale per run for the input and the output gradient, one per expert weight
    rowwise     per row (token) in the forward and input gradient, as a linear layer's; in the
                weight gradient (K = tokens) one per feature and run
    blockwise   1 x 128 tiles along K; in the weight gradient the 128-token tiles start at each
                run (one process tiles a micro-batch's rows of the expert); 128 x 128 blocks of
                each expert's weight

Taking them over all of an expert's rows instead mixes micro-batches, and the layouts then
differ (tests/moe/test_moe_training.py). A run of no rows casts nothing and adds nothing; its
amaxes are zeros, so ranks that reduce them stay in step. The weight gradient adds the runs'
products in order, in the weight's dtype, as one process's gradient accumulation adds its
micro-batches'. The expert weights' casts are kept for the step (gemm.kept_casts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatronish.fp8.gemm import kept_casts, product, tensorwise
from megatronish.fp8.quantize import Cast, Quantized, Split, quantize
from megatronish.fp8.recipes import Recipe

Counts = list[list[int]]  # [E_l][S] rows of each (expert, source) run


@dataclass(frozen=True)
class ExpertScales:
    """The tensorwise scales known so far ([E_l][S] runs' or [E_l] experts'; None entries when
    the recipe is not tensorwise)."""

    input: list[list[torch.Tensor | None]]
    weight: list[torch.Tensor | None]
    grad_output: list[list[torch.Tensor | None]] | None = None


def _runs(x: torch.Tensor, counts: Counts) -> list[list[torch.Tensor]]:
    """x [R, d] cut into its runs, [E_l][S] tensors [rows of the run, d]."""
    return _nest(list(x.split([n for per_expert in counts for n in per_expert])), counts)


def _nest(flat: list, counts: Counts) -> list[list]:
    """flat, one entry per run in expert-major order, as [E_l][S]."""
    sources = len(counts[0])
    return [flat[e * sources : (e + 1) * sources] for e in range(len(counts))]


def _rows_product(a: Quantized, b: Quantized, dtype: torch.dtype, backend: str) -> torch.Tensor:
    """gemm.product of a [M, K] and b [N, K], [M, N]: zeros where a run is empty (M or K 0)."""
    if a.payload.numel() == 0:
        return torch.zeros(
            a.payload.shape[0], b.payload.shape[0], dtype=dtype, device=a.payload.device
        )
    return product(a, b, dtype, backend)


def experts_forward(
    x: torch.Tensor, weight: torch.Tensor, counts: Counts, recipe: Recipe, split: Split
) -> tuple[torch.Tensor, ExpertScales]:
    """Y [R, out]: each run's rows X [n, in] times its expert's W^T, and the tensorwise scales."""
    casts = [
        Cast(run, recipe.input, rows=split.cp, k=split.tp("in"))
        for per_expert in _runs(x, counts)
        for run in per_expert
    ]
    weights = [
        Cast(w, recipe.weight, rows=split.tp("out"), k=split.tp("in")) for w in weight.unbind(0)
    ]
    qx, (qw,) = kept_casts(casts, [(weight, weights)], "forward", recipe, split)
    qx = _nest(qx, counts)
    out = [
        _rows_product(q, qw[e], x.dtype, recipe.backend) for e, runs in enumerate(qx) for q in runs
    ]
    scales = ExpertScales(
        input=[[tensorwise(q) for q in runs] for runs in qx],
        weight=[tensorwise(q) for q in qw],
    )
    return torch.cat(out), scales


def experts_grad_input(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    counts: Counts,
    recipe: Recipe,
    split: Split,
    scales: ExpertScales,
) -> tuple[torch.Tensor, ExpertScales]:
    """dX [R, in]: each run's dY [n, out] times its expert's W (a partial sum over tp for a
    column-split weight), and the scales with the output gradients'."""
    casts = [
        Cast(run, recipe.grad_output, rows=split.cp, k=split.tp("out"))
        for per_expert in _runs(grad_output, counts)
        for run in per_expert
    ]
    weights = [
        Cast(w.t(), recipe.weight, rows=split.tp("in"), k=split.tp("out"), scale=scale)
        for w, scale in zip(weight.unbind(0), scales.weight)
    ]
    qdy, (qwt,) = kept_casts(casts, [(weight, weights)], "input gradient", recipe, split)
    qdy = _nest(qdy, counts)
    dtype, backend = grad_output.dtype, recipe.backend
    out = [_rows_product(q, qwt[e], dtype, backend) for e, runs in enumerate(qdy) for q in runs]
    grad_scales = [[tensorwise(q) for q in runs] for runs in qdy]
    return torch.cat(out), ExpertScales(scales.input, scales.weight, grad_scales)


def experts_grad_weight(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Counts,
    recipe: Recipe,
    split: Split,
    scales: ExpertScales,
) -> torch.Tensor:
    """dW [E_l, out, in] in weight's dtype: for each expert the sum over its runs of dY^T [out, n]
    X [n, in], added in run order."""
    casts = []
    dy_runs, x_runs = _runs(grad_output, counts), _runs(x, counts)
    for e in range(len(counts)):
        for s, (dy, xs) in enumerate(zip(dy_runs[e], x_runs[e])):
            dy_scale, x_scale = scales.grad_output[e][s], scales.input[e][s]
            casts += [
                Cast(dy.t(), recipe.grad_output, rows=split.tp("out"), k=split.cp, scale=dy_scale),
                Cast(xs.t(), recipe.input, rows=split.tp("in"), k=split.cp, scale=x_scale),
            ]
    quantized = quantize(casts, recipe.power_of_2_scales, split, recipe.backend)
    grad = torch.zeros_like(weight)
    sources = len(counts[0])
    for e, per_expert in enumerate(counts):
        for s, rows in enumerate(per_expert):
            if rows == 0:
                continue
            qdyt, qxt = quantized[2 * (e * sources + s) : 2 * (e * sources + s) + 2]
            part = product(qdyt, qxt, grad_output.dtype, recipe.backend)
            grad[e].add_(part.to(weight.dtype))
    return grad


class _Fp8Experts(torch.autograd.Function):
    """The experts' x W_e^T with the three GEMMs in fp8; saves x and the weight as they are. A
    weight that needs no gradient (LoRA's frozen base) gets none: no weight-gradient GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, counts, recipe, split):
        out, scales = experts_forward(x, weight, counts, recipe, split)
        ctx.save_for_backward(x if weight.requires_grad else None)
        ctx.weight = weight  # itself (not a recompute's copy): the key of its kept casts
        ctx.counts, ctx.recipe, ctx.split, ctx.scales = counts, recipe, split, scales
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        counts, recipe, split = ctx.counts, ctx.recipe, ctx.split
        grad_in, scales = experts_grad_input(grad_out, weight, counts, recipe, split, ctx.scales)
        if x is None:
            return grad_in, None, None, None, None
        grad_weight = experts_grad_weight(grad_out, x, weight, counts, recipe, split, scales)
        return grad_in, grad_weight, None, None, None


def fp8_experts(
    x: torch.Tensor, weight: torch.Tensor, counts: Counts, recipe: Recipe, split: Split
) -> torch.Tensor:
    """x [R, in] (expert-major runs of counts [E_l][S]) times each run's expert weight
    weight[e]^T ([E_l, out, in]) -> [R, out] in x's dtype; no communication beyond the scales'
    amax all-reduces (one per GEMM that needs any)."""
    return _Fp8Experts.apply(x, weight, counts, recipe, split)
