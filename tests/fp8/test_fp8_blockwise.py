"""Blockwise fp8 (DeepSeek-V3's recipe with torchao's scale arithmetic): the cast of an operand in
1 x 128 tiles and in 128 x 128 blocks, and its dequantization, equal a plain float64
implementation written here, bit for bit in the fp8 payload, the scales and the values; tiles
and blocks at the end of a dimension that is not a multiple of 128 hold what is left."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatronish.fp8.quantize import Cast, Split, quantize
from megatronish.fp8.recipes import E4M3, Operand

E4M3_MAX = 448.0
EPS = 1e-12


def round_to_e4m3(y: np.ndarray) -> np.ndarray:
    """float64 values (|y| <= 448) rounded to the nearest e4m3fn value, ties to even: 3 mantissa
    bits for |y| >= 2^-6, multiples of 2^-9 below (subnormals)."""
    magnitude = np.abs(y)
    exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    step = np.where(magnitude >= 2.0**-6, 2.0 ** (exponent - 3), 2.0**-9)
    return np.round(y / step) * step  # np.round: half to even


def reference_cast(x: np.ndarray, tile_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(payload values, float32 scales, float32 dequantized values) of x [rows, K] cast to e4m3
    per tile_rows x 128 group: scale = fp32(448 / max(amax, 1e-12)) (float64 division), payload
    = e4m3(clamp(fp32(x * scale))), the product rounded to fp32 as the GPU forms it, value =
    fp32(payload / scale)."""
    rows, k = x.shape
    groups_r, groups_k = -(-rows // tile_rows), -(-k // 128)
    scales = np.zeros((groups_r, groups_k), dtype=np.float32)
    payload = np.zeros_like(x)
    values = np.zeros(x.shape, dtype=np.float32)
    for i in range(groups_r):
        for j in range(groups_k):
            rs, cs = slice(i * tile_rows, (i + 1) * tile_rows), slice(j * 128, (j + 1) * 128)
            group = x[rs, cs]
            amax = max(np.abs(group).max(), EPS)
            scale = np.float32(E4M3_MAX / amax)
            product = (group * np.float64(scale)).astype(np.float32).astype(np.float64)
            q = round_to_e4m3(np.clip(product, -E4M3_MAX, E4M3_MAX))
            scales[i, j], payload[rs, cs] = scale, q
            values[rs, cs] = (q / np.float64(scale)).astype(np.float32)
    return payload, scales, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("granularity", ["tile", "block"])
@pytest.mark.parametrize("shape", [(7, 300), (260, 257)])
def test_blockwise_cast_equals_a_float64_reference_bit_for_bit(shape, granularity, dtype):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randn(shape, generator=gen) * torch.logspace(-6, 3, shape[1])  # wide range per row
    x[0, :128] = 0.0  # an all-zero tile: the smallest amax
    x[-1, -1] = -3e4
    x = x.to(dtype)
    (ours,) = quantize([Cast(x, Operand(granularity, E4M3))], power_of_2=False, split=Split())
    payload, scales, values = reference_cast(
        x.double().numpy(), tile_rows=1 if granularity == "tile" else 128
    )
    assert ours.payload.dtype == E4M3
    assert np.array_equal(ours.payload.double().numpy(), payload)
    assert ours.scale.dtype == torch.float32
    assert np.array_equal(ours.scale.numpy(), scales)
    assert np.array_equal(ours.values().numpy(), values)
    assert (np.abs(payload) == E4M3_MAX).any()  # each group's amax lands on the fp8 max
    assert (payload == 0).any() and (np.abs(payload) < 2.0**-6).any()  # zeros and subnormals
