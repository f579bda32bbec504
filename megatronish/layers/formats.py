"""A linear layer's numeric format: how it casts its operands and runs its three GEMMs (forward,
input gradient, weight gradient), used by the layer (megatronish.layers.linear) whatever its
communication. HighPrecision: the autocast precision, torch's GEMMs; Fp8(recipe): fp8 operands
by an fp8 recipe (megatronish.fp8), their amaxes reduced over the groups of the layer's Split.
A new format is one more class with these four methods.

Shapes: x [..., in], weight [out, in], grad [..., out]; `rows` operands are [tokens, features].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatronish.fp8 import (
    Recipe,
    Split,
    forward_gemm,
    fp8_linear,
    grad_input_gemm,
    grad_weight_gemm,
)
from megatronish.fp8.gemm import add_bias


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype when autocast is on for its device (else x): cast before a
    collective, so activations and their gradients cross the wire in bf16, not fp32."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class HighPrecision:
    """The autocast precision: torch's GEMMs, nothing cast, nothing reduced."""

    def linear(self, x, weight, bias, split: Split) -> torch.Tensor:
        """x W^T + b with autograd's own backward."""
        return F.linear(x, weight, bias)

    def forward(self, x, weight, bias, split: Split) -> tuple[torch.Tensor, Any]:
        """(x W^T + b, what the backward GEMMs need of the forward's casts: nothing)."""
        return F.linear(x, weight, bias), None

    def grad_input(self, grad, weight, split: Split, state: Any) -> tuple[torch.Tensor, Any]:
        """(grad W, what the weight gradient needs of this GEMM's casts: nothing)."""
        return grad.matmul(weight.to(grad.dtype)), None

    def grad_weight(self, grad_rows, x_rows, weight, split: Split, state: Any) -> torch.Tensor:
        """grad^T x in weight's dtype (the GEMM in grad's)."""
        return grad_rows.t().matmul(x_rows.to(grad_rows.dtype)).to(weight.dtype)


@dataclass(frozen=True)
class Fp8:
    """fp8 operands by `recipe` (megatronish.fp8.gemm): each GEMM casts its operands, the
    scales of tensors split over split's groups reduced over them, so every layout computes the
    same; the output in the input's dtype."""

    recipe: Recipe

    def linear(self, x, weight, bias, split: Split) -> torch.Tensor:
        """x W^T + b, x in autocast's dtype."""
        return add_bias(fp8_linear(to_autocast_dtype(x), weight, self.recipe, split), bias)

    def forward(self, x, weight, bias, split: Split) -> tuple[torch.Tensor, Any]:
        """(x W^T + b, the forward's scales that backward reuses)."""
        out, scales = forward_gemm(_rows(x), weight, self.recipe, split)
        return add_bias(out.view(*x.shape[:-1], -1), bias), scales

    def grad_input(self, grad, weight, split: Split, state: Any) -> tuple[torch.Tensor, Any]:
        """(grad W, the scales the weight gradient reuses)."""
        out, scales = grad_input_gemm(_rows(grad), weight, self.recipe, split, state)
        return out.view(*grad.shape[:-1], -1), scales

    def grad_weight(self, grad_rows, x_rows, weight, split: Split, state: Any) -> torch.Tensor:
        """grad^T x in weight's dtype."""
        return grad_weight_gemm(grad_rows, x_rows, self.recipe, split, state).to(weight.dtype)


HIGH_PRECISION = HighPrecision()


def numeric_format(recipe: Recipe | None) -> HighPrecision | Fp8:
    """The format of a layer whose plan has `recipe` (None: the autocast precision)."""
    return HIGH_PRECISION if recipe is None else Fp8(recipe)
