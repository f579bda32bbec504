"""One scale from one amax, and the casts on either side of it, with the arithmetic of
torchao's float8 training (so our emulation and its Float8Linear agree bit for bit):

    scale = fp8_max / max(amax, 1e-12)   computed in float64, rounded to float32
    (rowwise: rounded down to a power of two, exp2(floor(log2(scale))))
    payload = fp8(clamp(float32(x) * scale, -fp8_max, fp8_max))   saturating, round to nearest even
    value = float32(payload) / scale     dequantization divides by the scale

A scale multiplies a tensor into the fp8 range; dividing by it goes back.
"""

from __future__ import annotations

import torch

AMAX_EPS = 1e-12
"""The smallest amax a scale is computed from (an all-zero tensor gets a finite scale)."""


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return torch.finfo(dtype).max


@torch.no_grad()
def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """float32 scales of amax (any shape, any float dtype) for casting to `dtype`."""
    scale = (fp8_max(dtype) / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


@torch.no_grad()
def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x times scale (broadcast against x) in float32, saturated to the fp8 range, as `dtype`."""
    limit = fp8_max(dtype)
    return (x.to(torch.float32) * scale).clamp(min=-limit, max=limit).to(dtype)


def dequantize(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of an fp8 payload and its scale (broadcast against it)."""
    return payload.to(torch.float32) / scale
