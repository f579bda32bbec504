"""The three fp8 recipes (train.fp8_recipe): how each operand of a linear layer's three GEMMs
is scaled.

Every GEMM is read as out [M, N] = A [M, K] B [N, K]^T, K the dimension it sums over:

    forward      Y  = X  W^T     A = X [T, in]      B = W   [out, in]   K = in
    grad input   dX = dY W       A = dY [T, out]    B = W^T [in, out]   K = out
    grad weight  dW = dY^T X     A = dY^T [out, T]  B = X^T [in, T]     K = T (tokens)

and an operand's granularity is relative to its K:

    tensor  one scale for the whole tensor
    row     one scale per row (amax along K): per token of X and dY, per output row of W in
            the forward, per input column of W and per feature over the tokens in backward
    tile    one scale per 1 x 128 tile along K (a row's 128 consecutive K entries)
    block   one scale per 128 x 128 block

tensorwise: torchao's default Float8LinearConfig, e4m3 inputs and weights, e5m2 output
gradients. rowwise: torchao's "rowwise" recipe, e4m3 throughout, scales rounded down to powers
of two. blockwise: DeepSeek-V3's, 1 x 128 tiles of activations and output gradients (along the
tokens in the weight-gradient GEMM: 128 x 1 of the untransposed tensors), 128 x 128 blocks of
the weight, e4m3 throughout, with torchao's blockwise scale arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Granularity = Literal["tensor", "row", "tile", "block"]
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class Operand:
    """How one operand is cast to fp8: the granularity of its scales and the fp8 dtype."""

    granularity: Granularity
    dtype: torch.dtype


@dataclass(frozen=True)
class Recipe:
    """The casts of a linear layer's input, weight and output gradient, the same in every GEMM
    that reads them, and whether scales are rounded down to powers of two. backend: the
    kernels.backend the casts and GEMMs run with (megatronish.fp8.kernels)."""

    name: str
    input: Operand
    weight: Operand
    grad_output: Operand
    power_of_2_scales: bool
    backend: str = "auto"


RECIPES = {
    "tensorwise": Recipe(
        "tensorwise",
        Operand("tensor", E4M3),
        Operand("tensor", E4M3),
        Operand("tensor", E5M2),
        power_of_2_scales=False,
    ),
    "rowwise": Recipe(
        "rowwise",
        Operand("row", E4M3),
        Operand("row", E4M3),
        Operand("row", E4M3),
        power_of_2_scales=True,
    ),
    "blockwise": Recipe(
        "blockwise",
        Operand("tile", E4M3),
        Operand("block", E4M3),
        Operand("tile", E4M3),
        power_of_2_scales=False,
    ),
}
