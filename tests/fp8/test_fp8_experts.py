"""The experts' fp8 grouped GEMMs (megatronish.fp8.grouped) are, for each (expert, source) run of
rows, our fp8 linear layer's GEMMs on those rows (itself judged bit for bit by torchao,
tests/fp8/test_fp8_torchao.py): the output and the input gradient bit for bit, and each expert's
weight gradient the sum of its runs' weight gradients, bit for bit as gradient accumulation
adds them, in every recipe, with an expert of no rows and empty runs; blockwise at 128-multiple
sizes with runs longer than a 128-token tile, whose weight-gradient tiles start again at each
run. Scales taken over all of an expert's rows instead give other numbers (the comparison can
fail)."""

from __future__ import annotations

import pytest
import torch

from megatronish.fp8 import RECIPES, Split, fp8_experts, fp8_linear, weights_changed
from tests.tolerances import FP32_FEW_OPS_REL, FP32_REORDER

# [E_l][S] rows per (expert, source): expert 1 has none, expert 2's second source sent none.
COUNTS = [[5, 3], [0, 0], [4, 0]]
# blockwise at 128-multiple sizes: runs longer than a tile, not multiples of it.
BLOCK_COUNTS = [[130, 0], [3, 200]]


def inputs(counts, d_in: int, d_out: int, dtype: torch.dtype, seed: int):
    """x [R, d_in] (the second source's rows 8x larger, so a scale over both sources differs
    from each's), weight [E_l, d_out, d_in] whose experts differ in size, dy [R, d_out]."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(map(sum, counts))
    x = torch.randn(rows, d_in, generator=gen)
    start = 0
    for per_expert in counts:
        start += per_expert[0]
        x[start : start + sum(per_expert[1:])] *= 8
        start += sum(per_expert[1:])
    weight = torch.randn(len(counts), d_out, d_in, generator=gen) * 0.05
    weight[0] *= 20
    dy = torch.randn(rows, d_out, generator=gen) * 1e-3
    return x.to(dtype), weight, dy.to(dtype)


def ours(recipe, counts, x, weight, dy):
    weights_changed()
    x = x.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = fp8_experts(x, w, counts, RECIPES[recipe], Split())
    out.backward(dy)
    return out, x.grad, w.grad


def per_run(recipe, counts, x, weight, dy, runs_of=lambda per_expert: per_expert):
    """Our fp8 linear layer on each run's rows (runs_of: how an expert's rows are cut), each
    expert's weight gradient accumulated over its runs by autograd."""
    weights_changed()
    outs, grads, weight_grads, start = [], [], [], 0
    for e, per_expert in enumerate(counts):
        w = weight[e].clone().requires_grad_()
        for rows in runs_of(per_expert):
            if rows == 0:
                continue
            xs = x[start : start + rows].clone().requires_grad_()
            out = fp8_linear(xs, w, RECIPES[recipe], Split())
            out.backward(dy[start : start + rows])
            outs.append(out)
            grads.append(xs.grad)
            start += rows
        weight_grads.append(w.grad if w.grad is not None else torch.zeros_like(w))
    return torch.cat(outs), torch.cat(grads), torch.stack(weight_grads)


def assert_equal(got, want) -> None:
    for what, a, b in zip(("output", "input gradient", "weight gradient"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_expert_gemms_are_the_fp8_linear_layer_on_each_expert_and_source_run(recipe, dtype):
    x, weight, dy = inputs(COUNTS, 24, 20, dtype, seed=len(recipe))
    got = ours(recipe, COUNTS, x, weight, dy)
    assert_equal(got, per_run(recipe, COUNTS, x, weight, dy))
    assert torch.equal(got[2][1], torch.zeros_like(got[2][1]))  # no rows, no gradient


def test_blockwise_weight_gradient_tiles_start_again_at_each_run():
    x, weight, dy = inputs(BLOCK_COUNTS, 128, 256, torch.float32, seed=3)
    got = ours("blockwise", BLOCK_COUNTS, x, weight, dy)
    assert_equal(got, per_run("blockwise", BLOCK_COUNTS, x, weight, dy))
    whole = per_run("blockwise", BLOCK_COUNTS, x, weight, dy, lambda per: [sum(per)])
    # per-token tiles: the forward does not group rows (the same casts; matmuls of other sizes)
    torch.testing.assert_close(got[0], whole[0], rtol=FP32_FEW_OPS_REL, atol=FP32_REORDER)
    assert not torch.equal(got[2][1], whole[2][1])  # tiles over both runs: another gradient


def test_tensorwise_scales_over_all_of_an_experts_rows_give_other_numbers():
    x, weight, dy = inputs(COUNTS, 24, 20, torch.float32, seed=5)
    got = ours("tensorwise", COUNTS, x, weight, dy)
    whole = per_run("tensorwise", COUNTS, x, weight, dy, lambda per: [sum(per)])
    for a, b in zip(got, whole):
        assert not torch.equal(a, b)
