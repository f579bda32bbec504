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

from megatronish.fp8 import RECIPES
from megatronish.layers import ColumnParallelLinear, RowParallelLinear


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
    ours = layer_class(37, 23)
    ours.fp8_recipe = RECIPES[recipe]
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
        layer = ColumnParallelLinear(37, 23)
        layer.fp8_recipe = RECIPES[recipe]
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        outputs.append(layer(x))
    assert not torch.equal(*outputs)
    exact = nn.functional.linear(x, weight, bias)
    for out in outputs:  # fp8 is near the fp32 product, and not equal to it
        assert 0 < (out - exact).abs().max() < 0.1 * exact.abs().max()
