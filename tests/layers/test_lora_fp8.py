"""LoRA under fp8: the base GEMM takes fp8 operands and the adapters stay in high precision. A
column- and a row-parallel layer in each recipe, with adapters whose B is not zero (as after
training): the output is the base layer's own fp8 output plus (alpha / r) B A x computed in
fp32, to the rounding of that one addition, and the adapters' gradients are fp32 autograd's
of (alpha / r) B A x against the same output gradient. An adapter cast to fp8 would be off by
up to an fp8 step, 2^-4 relative, far beyond that rounding; the base output itself is off its
fp32 product by about that much (the test sees fp8 at work)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatronish.fp8 import RECIPES
from megatronish.layers import ColumnParallelLinear, RowParallelLinear
from megatronish.layers.lora import ColumnAdapters, Lora, RowAdapter
from megatronish.layers.plan import LinearPlan
from tests.tolerances import EXACT, FP32_FEW_OPS_REL, U_E4M3, U_FP32

LORA = Lora(rank=4, alpha=8.0)
D_IN, D_OUT = 48, 40  # whole rowwise blocks; not powers of two


def _layer(kind: str, recipe: str):
    """A tp 1 layer of `kind` under the fp8 recipe with its adapter, A and B random."""
    plan = LinearPlan(RECIPES[recipe])
    if kind == "column":
        lora = ColumnAdapters(LORA, D_IN, {"q_proj": D_OUT}, 1, ("q_proj",), None)
        layer = ColumnParallelLinear(D_IN, D_OUT, bias=False, plan=plan, lora=lora)
        adapter = lora.adapters["q_proj"]
    else:
        lora = RowAdapter(LORA, D_IN, D_OUT, None, sequence_parallel=False)
        layer = RowParallelLinear(D_IN, D_OUT, bias=False, plan=plan, lora=lora)
        adapter = lora.adapter
    with torch.no_grad():
        for param in adapter.values():
            param.normal_(0.0, 0.2)
    return layer, adapter


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_the_adapters_stay_in_fp32_beside_an_fp8_base_gemm(kind, recipe):
    torch.manual_seed(0)
    layer, adapter = _layer(kind, recipe)
    x = torch.randn(2, 7, D_IN)
    grad_out = torch.randn(2, 7, D_OUT)
    out = layer(x)
    out.backward(grad_out)
    lora, layer.lora = layer.lora, None
    with torch.no_grad():
        base = layer(x)
    layer.lora = lora
    a, b = (adapter[name].detach().clone().requires_grad_() for name in ("lora_A", "lora_B"))
    want = F.linear(F.linear(x, a), b) * LORA.scale
    want.backward(grad_out)
    # (base + adapters) - base: two fp32 roundings of values at most |out| and |base|
    bound = 2 * U_FP32 * (out.abs() + base.abs())
    assert ((out.detach() - base) - want.detach()).abs().le(bound).all()
    for ours, theirs in ((adapter["lora_A"], a), (adapter["lora_B"], b)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=FP32_FEW_OPS_REL, atol=EXACT)
    exact = F.linear(x, layer.weight)
    assert (base - exact).abs().max() > U_E4M3 / 16 * exact.abs().max()  # fp8 at work
