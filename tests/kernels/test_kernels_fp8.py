"""The fp8 kernels (megatronish_kernels.fp8_cast, fp8_gemm) under Triton's interpreter: the
fused casts give megatronish.fp8's payloads and scales bit for bit (computed on the CPU, the
path the emulation takes), the scaled GEMM equals a float64 product of the dequantized
operands within fp32 rounding, and megatronish.fp8 on the kernels (kernels.backend triton)
equals it on torch.

The interpreter has the fp8 dtypes (stored as bytes), but converts float32 to fp8 with a
rounding of its own (not ties to even); the kernels round in float32 arithmetic first, so the
conversion only meets exact fp8 values, and the payloads are compared as stored.
"""

from __future__ import annotations

import pytest
import torch

from megatronish.fp8 import RECIPES, Parts, fp8_linear
from megatronish.fp8 import granularity as groups
from megatronish.fp8 import quantize as quantize_module
from megatronish.fp8.quantize import Cast, Split, TokenGroups, quantize
from megatronish.fp8.scaling import amax_to_scale, cast_to_fp8
from tests.kernel_env import kernels
from tests.tolerances import EXACT, U_BF16, U_E5M2, U_FP32

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _torch_cast(x, granularity, dtype, power_of_2, scale=None):
    """megatronish.fp8's cast on the CPU: (payload bytes, scale bits)."""
    x = x.cpu()
    if scale is None:
        scale = amax_to_scale(groups.amax(x, granularity), dtype, power_of_2)
    scale = scale.cpu()
    payload = cast_to_fp8(x, groups.expand(scale, granularity, x.shape), dtype)
    return payload.contiguous().view(torch.uint8), scale.view(torch.int32)


def _bits(payload, scale):
    return payload.cpu().view(torch.uint8), scale.cpu().view(torch.int32)


def _operand(rows: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Values over 12 decades (fp8 subnormals, normals and saturation after scaling), a zero
    row and a negative zero."""
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(rows, k, generator=gen)
        * torch.logspace(-8, 4, k)[torch.randperm(k, generator=gen)]
    )
    x[1] = 0.0
    x[2, 3] = -0.0
    return x.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_cast_rounds_ties_to_even_and_saturates_as_torch_does(dtype):
    """Every finite fp8 value, the midpoints between neighbours (ties), values a hair either
    side of them, and values past the fp8 maximum, cast with the scale 1."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()  # sorted, -max .. max
    mid = (values[1:].double() + values[:-1].double()) / 2
    near = torch.cat([mid * (1 - 2.0**-20), mid, mid * (1 + 2.0**-20)]).float()
    limit = torch.finfo(dtype).max
    beyond = torch.tensor([limit * 1.01, -limit * 1.5, 1e30, -1e30])
    x = torch.cat([values, near, beyond]).reshape(1, -1).to(DEVICE)
    one = torch.ones((), device=DEVICE)
    got = _bits(*kernels.fp8_cast(x, "tensor", dtype, scale=one))
    want = _torch_cast(x, "tensor", dtype, False, scale=one)
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_fused_casts_equal_megatronish_fp8_bit_for_bit(granularity):
    """fp32 and bf16, a plain and a transposed operand (the weight-gradient GEMM's), sizes that
    are not multiples of 128, each fp8 type, with and without power-of-two scales."""
    cases = [(torch.float32, E4M3, False, False), (torch.bfloat16, E5M2, True, True)]
    for seed, (x_dtype, dtype, transpose, power_of_2) in enumerate(cases):
        x = _operand(70, 300, seed, x_dtype)
        x = x.t() if transpose else x
        got = _bits(*kernels.fp8_cast(x, granularity, dtype, power_of_2))
        want = _torch_cast(x, granularity, dtype, power_of_2)
        assert torch.equal(got[1].reshape(want[1].shape), want[1]), (seed, "scales")
        assert torch.equal(got[0], want[0]), (seed, "payload")


def test_power_of_2_scales_round_as_float32_log2_does_at_the_top_of_a_binade():
    """Scales just below a power of two, where log2 in float32 rounds up to the power (so the
    floor is one more than the scale's exponent): the kernel's scales are torch's."""
    below = torch.tensor([2.0**k for k in range(-3, 20)]).view(torch.int32)
    below = (below[:, None] - torch.arange(1, 9, dtype=torch.int32)).view(torch.float32)
    amax = (448.0 / below.double().reshape(-1)).float()
    x = (amax[:, None] * torch.linspace(-1, 1, 33)).to(DEVICE)  # one row each, amax at the ends
    _, scale = kernels.fp8_cast(x, "row", E4M3, power_of_2=True)
    want = amax_to_scale(amax.reshape(-1, 1), E4M3, True)
    assert torch.equal(scale.cpu(), want)
    exact = amax_to_scale(amax.reshape(-1, 1), E4M3, False)
    assert (want > exact).any()  # the case exists: a power above the float32 scale


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_casts_from_a_reduced_amax_or_a_known_scale_equal_megatronish_fp8(granularity):
    x = _operand(40, 200, 7)
    amax = groups.amax(x, granularity) * 2  # as if another rank held larger values
    scale = amax_to_scale(amax.cpu(), E4M3, False)
    from_amax = _bits(*kernels.fp8_cast(x, granularity, E4M3, amax=amax.float()))
    from_scale = _bits(*kernels.fp8_cast(x, granularity, E4M3, scale=scale.to(DEVICE)))
    want = _torch_cast(x, granularity, E4M3, False, scale=scale)
    for got in (from_amax, from_scale):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].reshape(want[1].shape), want[1])
    if granularity == "tensor":
        assert torch.equal(kernels.fp8_amax(x).cpu(), groups.amax(x, "tensor").reshape(1).cpu())


def _dequantized(payload, scale, granularity):
    payload, scale = payload.cpu().double(), scale.cpu().double()
    return payload / groups.expand(scale, granularity, payload.shape)


# The three GEMMs of the blockwise recipe (A tiles along K; B blocks, or tiles in the weight
# gradient), and the tensor and row scales: (A, B, A's and B's granularity) as (tokens, in, out).
GEMMS = {
    "forward": lambda x, w, dy: (x, w, "tile", "block"),
    "grad_input": lambda x, w, dy: (dy, w.t(), "tile", "block"),
    "grad_weight": lambda x, w, dy: (dy.t(), x.t(), "tile", "tile"),
    "tensorwise": lambda x, w, dy: (x, w, "tensor", "tensor"),
    "rowwise": lambda x, w, dy: (x, w, "row", "row"),
}


@pytest.mark.parametrize("gemm", list(GEMMS))
def test_scaled_gemm_equals_float64_within_fp32_rounding(gemm):
    """out = sum over K blocks of an fp8 dot (exact products, fp32 sums of 128) divided by the
    two scales' reciprocals: at most about K + 5 fp32 roundings of sum |a b| (2^-24 each), and in
    bf16 the output's rounding on top: one bf16 ulp, 2^-7 of |out| (the interpreter truncates
    float32 to bf16; a GPU rounds to nearest, half that)."""
    gen = torch.Generator().manual_seed(3)
    tokens, d_in, d_out = 40, 200, 136
    x, w = torch.randn(tokens, d_in, generator=gen), torch.randn(d_out, d_in, generator=gen)
    dy = torch.randn(tokens, d_out, generator=gen)
    a, b, ga, gb = GEMMS[gemm](*(t.to(DEVICE) for t in (x, w, dy)))
    qa, sa = kernels.fp8_cast(a, ga, E4M3)
    qb, sb = kernels.fp8_cast(b, gb, E4M3)
    da, db = _dequantized(qa, sa, ga), _dequantized(qb, sb, gb)
    want, magnitude = da @ db.t(), da.abs() @ db.abs().t()
    k = a.shape[1]
    for out_dtype, relative in ((torch.float32, EXACT), (torch.bfloat16, 2 * U_BF16)):
        got = kernels.fp8_gemm(qa, qb, sa, sb, out_dtype, b_block=gb == "block").cpu().double()
        bound = (k + 5) * U_FP32 * magnitude + relative * want.abs()
        assert got.shape == want.shape
        assert ((got - want).abs() <= bound).all(), ((got - want).abs() / magnitude).max()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_an_fp8_linear_on_the_kernels_equals_it_on_torch(recipe, monkeypatch):
    """megatronish.fp8 with kernels.backend triton: the output and both gradients equal the
    emulation's up to fp32 summation order, the weight's rows three logical matrices (scaled and
    tiled each alone: megatronish.fp8.parts); the casts of quantize are the emulation's bit for
    bit, also where an amax is reduced over ranks first (a group of two ranks, stood in for)."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 256, generator=gen).to(DEVICE)
    weight = (torch.randn(136, 256, generator=gen) / 16).to(DEVICE)
    dy = torch.randn(40, 136, generator=gen).to(DEVICE)
    results = []
    for backend in ("torch", "triton"):
        fp8 = replace(RECIPES[recipe], backend=backend)
        inputs = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fp8_linear(*inputs, fp8, Split(parts=Parts((36, 16, 16))))  # two units of 68
        out.backward(dy)
        results.append([out, inputs[0].grad, inputs[1].grad])
    # The same fp8 operands summed in another order: (K + 5) fp32 roundings of sum |a b| (the
    # fp8 operands within 2^-3 of the inputs' magnitudes: e5m2 keeps 2 mantissa bits).
    grow = (1 + U_E5M2) ** 2
    magnitudes = [
        (x.abs() @ weight.abs().t(), 256),
        (dy.abs() @ weight.abs(), 136),
        (dy.abs().t() @ x.abs(), 40),
    ]
    for got, want, (magnitude, k) in zip(results[1], results[0], magnitudes):
        assert ((got - want).abs() <= (k + 5) * U_FP32 * grow * magnitude).all()

    # x's tokens over cp and K over tp, the weight's rows over tp: one all-reduce of the amaxes
    # (tensorwise: over the tp x cp group; rowwise: x's rows over tp; blockwise: none), whose
    # other ranks stand in as doubling them; the kernels' casts scale from the reduced amaxes.
    groups_seen = []

    def all_reduce(tensor, group, op):
        groups_seen.append(group)
        tensor.mul_(2)

    monkeypatch.setattr(quantize_module.comm, "group_size", lambda group: 2)
    monkeypatch.setattr(quantize_module.comm, "all_reduce", all_reduce)
    spec, tp, cp = RECIPES[recipe], frozenset({"tp"}), frozenset({"cp"})
    split = Split(group="tp", tokens=TokenGroups(cp="cp", tp_cp="tp x cp"))
    casts = [Cast(x, spec.input, rows=cp, k=tp), Cast(weight, spec.weight, rows=tp)]
    fused = quantize(casts, spec.power_of_2_scales, split, "triton")
    assert groups_seen == {"tensorwise": ["tp x cp"], "rowwise": ["tp"], "blockwise": []}[recipe]
    for got, want in zip(fused, quantize(casts, spec.power_of_2_scales, split, "torch")):
        assert torch.equal(
            got.payload.cpu().view(torch.uint8), want.payload.cpu().view(torch.uint8)
        )
        assert torch.equal(got.scale.cpu(), want.scale.cpu())
