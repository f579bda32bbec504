"""Judged by torchao: a column- and a row-parallel layer with an fp8 recipe (one device) compute
the forward output and the input, weight and bias gradients of torchao's
Float8Linear(emulate=True) on the same weights and inputs, bit for bit, in the tensorwise
(torchao's default config) and rowwise recipes, from fp32 and bf16 inputs. The same layers at
tp 2 and 4 equal this single-device computation (tests/layers/test_layers.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

from megatronish.fp8 import RECIPES, Parts
from megatronish.layers import ColumnParallelLinear, RowParallelLinear
from megatronish.layers.plan import LinearPlan
from tests.tolerances import fp8_product_magnitude, reordered_sum_bound


def torchao_linear(recipe: str, weight: torch.Tensor, bias: torch.Tensor) -> Float8Linear:
    """torchao's emulated fp8 linear layer of `recipe` holding copies of weight and bias."""
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    linear = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return Float8Linear.from_float(linear, config=config)


def inputs(dtype: torch.dtype, d_in: int, d_out: int, seed: int):
    """x [3, 5, d_in] in dtype with an outlier, fp32 weight [d_out, d_in] whose rows span two
    orders of magnitude, fp32 bias, and an output gradient in dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, d_in, generator=gen)
    x[1, 2, 3] = 40.0
    weight = torch.randn(d_out, d_in, generator=gen) * 0.05
    weight[: d_out // 3] *= 30
    bias = torch.randn(d_out, generator=gen)
    grad = torch.randn(3, 5, d_out, generator=gen) * 1e-3
    return x.to(dtype), weight, bias, grad.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer_class", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_layer_equals_torchao_float8_linear_bit_for_bit(recipe, layer_class, dtype):
    x, weight, bias, grad = inputs(dtype, d_in=37, d_out=23, seed=len(recipe))
    ours = layer_class(37, 23, plan=LinearPlan(RECIPES[recipe]))
    with torch.no_grad():
        ours.weight.copy_(weight)
        ours.bias.copy_(bias)
    reference = torchao_linear(recipe, weight, bias)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_ref = ours(x_ours), reference(x_ref)
    out_ours.backward(grad)
    out_ref.backward(grad)
    assert out_ours.dtype == out_ref.dtype == dtype
    pairs = {
        "output": (out_ours, out_ref),
        "input gradient": (x_ours.grad, x_ref.grad),
        "weight gradient": (ours.weight.grad, reference.weight.grad),
        "bias gradient": (ours.bias.grad, reference.bias.grad),
    }
    for what, (got, want) in pairs.items():
        assert got.dtype == want.dtype, what
        assert torch.equal(got, want), f"{what}: max diff {(got - want).abs().max().item():.3e}"


def test_rowwise_and_tensorwise_differ_so_the_comparison_can_fail():
    x, weight, bias, _ = inputs(torch.float32, d_in=37, d_out=23, seed=0)
    outputs = []
    for recipe in ("tensorwise", "rowwise"):
        layer = ColumnParallelLinear(37, 23, plan=LinearPlan(RECIPES[recipe]))
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        outputs.append(layer(x))
    assert not torch.equal(*outputs)
    exact = nn.functional.linear(x, weight, bias)
    for out in outputs:  # fp8 is near the fp32 product, and not equal to it
        assert 0 < (out - exact).abs().max() < 0.1 * exact.abs().max()


def _qkv_layer(weights: dict[str, torch.Tensor], groups: int, recipe: str, parts):
    """Our column layer of q, k and v fused in our row order (per key-value group its query
    heads', its key head's, its value head's rows) in `recipe`, with out_parts `parts`."""
    rows = torch.cat([w.view(groups, -1, w.shape[1]) for w in weights.values()], dim=1)
    out_features = rows.shape[0] * rows.shape[1]
    plan = LinearPlan(RECIPES[recipe])
    layer = ColumnParallelLinear(
        rows.shape[2], out_features, bias=False, out_parts=parts, plan=plan
    )
    with torch.no_grad():
        layer.weight.copy_(rows.reshape(-1, rows.shape[2]))
    return layer


def _within_fp32_sums(got, want, a, b) -> bool:
    """Whether got and want, two fp32 sums of the fp8 product a b^T [M, K] [N, K] in other
    orders (or split in parts), differ by at most 2 (K + 2) u of the sum of the products'
    magnitudes (an fp8 value within 1/8 of its operand's, plus a subnormal's step)."""
    k = a.shape[-1]
    magnitude = fp8_product_magnitude(a.reshape(-1, k), b.reshape(-1, k)).view(want.shape)
    err = (got.double() - want.double()).abs()
    return bool((err <= reordered_sum_bound(k + 2) * magnitude).all())


def _separate_linear(recipe: str, weight: torch.Tensor) -> nn.Module:
    """The judge of one projection: torchao's Float8Linear (rowwise), or our own layer of one
    matrix (blockwise, whose casts equal torchao's blockwise arithmetic:
    tests/fp8/test_fp8_blockwise.py)."""
    if recipe == "rowwise":
        return torchao_linear(recipe, weight, torch.zeros(weight.shape[0]))
    plan = LinearPlan(RECIPES[recipe])
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], bias=False, plan=plan)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


@pytest.mark.parametrize(
    "recipe, head_dim, wrong",
    [
        ("rowwise", 3, {"input gradient"}),
        # a block of a group's k and v heads' 64 rows each, where k_proj's holds both k heads
        ("blockwise", 64, {"k output", "v output", "input gradient"}),
    ],
)
def test_fused_qkv_takes_the_scales_of_transformers_separate_projections(recipe, head_dim, wrong):
    """Our q, k and v in one layer with out_parts give each of three separate layers (rowwise:
    torchao's Float8Linears) its output and weight gradient, and their summed input gradients,
    to fp32 rounding; the fused layer without out_parts misses those `wrong`: its scales over
    the three together squeeze q's weights (k's are larger) and k's output gradients (q's
    are), rowwise towards fp8's subnormals."""
    groups, per_group, d, h = 2, 2, head_dim, 37
    gen = torch.Generator().manual_seed(3)
    weights = {
        "q": torch.randn(groups * per_group * d, h, generator=gen) * 0.05,
        "k": torch.randn(groups * d, h, generator=gen) * 51.2,  # 1024 times q's and v's
        "v": torch.randn(groups * d, h, generator=gen) * 0.05,
    }
    x = torch.randn(3, 5, h, generator=gen)
    grad = torch.randn(3, 5, (per_group + 2) * d * groups, generator=gen) * 1e-3
    parts = (per_group * d, d, d)
    index = dict(zip(weights, Parts(parts).index(grad.shape[-1], x.device)))
    grad[..., index["q"]] *= 1024  # and q's output gradients k's and v's
    references = {n: _separate_linear(recipe, w) for n, w in weights.items()}
    x_refs = {n: x.clone().requires_grad_() for n in weights}
    outs = {n: references[n](x_refs[n]) for n in weights}
    for n in weights:
        outs[n].backward(grad[..., index[n]])
    want_dx = x_refs["q"].grad + x_refs["k"].grad + x_refs["v"].grad
    for layer_parts in (parts, None):
        ours = _qkv_layer(weights, groups, recipe, layer_parts)
        x_ours = x.clone().requires_grad_()
        out = ours(x_ours)
        out.backward(grad)
        checks = {"input gradient": (x_ours.grad, want_dx, grad, ours.weight.t())}
        for n, w in weights.items():
            dy_t, x_t = grad[..., index[n]].reshape(-1, w.shape[0]).t(), x.reshape(-1, h).t()
            got_dw, want_dw = ours.weight.grad[index[n]], references[n].weight.grad
            checks[f"{n} output"] = (out[..., index[n]], outs[n], x, w)
            checks[f"{n} weight gradient"] = (got_dw, want_dw, dy_t, x_t)
        failed = {what for what, args in checks.items() if not _within_fp32_sums(*args)}
        assert failed == (set() if layer_parts else wrong), (layer_parts, failed)
