"""The fp8 numeric format of a linear layer (megatronish.layers.formats): its GEMMs those of
megatronish.fp8.gemm by a recipe, on the plain layer and on the decomposed schedules of
megatronish.layers.overlap, where a gathered input can travel as its fp8 cast (``pack``) and
each chunk's GEMM carries exactly the scales of the whole layer's: docs/fp8.md (With the tp
communication under the GEMMs).

Shapes: b batch, c a sequence chunk; an operand's rows are its tokens, batch-major.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from megatronish.fp8 import (
    Recipe,
    Split,
    forward_gemm,
    fp8_linear,
    grad_input_gemm,
    grad_weight_gemm,
)
from megatronish.fp8.gemm import (
    Scales,
    add_bias,
    forward_casts,
    forward_product,
    grad_input_casts,
    summed_product,
    tensorwise,
)
from megatronish.fp8.granularity import layout
from megatronish.fp8.quantize import Cast, Quantized, quantize
from megatronish.layers.formats import rows, seq, to_autocast_dtype

TP = frozenset({"tp"})
SCALE_BYTES = 4  # a float32 scale


def _block(q: Quantized, batch: int, index: int, parts: int) -> Quantized:
    """Sequence chunk `index` of `parts` of q (rows [b * s], batch-major): [b * c, K]."""

    def chunk(t: torch.Tensor) -> torch.Tensor:
        whole = t.view(batch, -1, t.shape[-1])
        c = whole.shape[1] // parts
        return rows(whole[:, index * c : (index + 1) * c])

    scale = q.scale if q.operand.granularity == "tensor" else chunk(q.scale)
    return Quantized(chunk(q.payload), scale, q.operand)


def pack(q: Quantized, batch: int) -> torch.Tensor:
    """A chunk's fp8 cast as bytes to send, [b, c, K + 4 n]: each token's payload, then its n
    float32 scales (none for a tensorwise cast)."""
    payload = q.payload.view(torch.uint8).view(batch, -1, q.payload.shape[-1])
    if q.operand.granularity == "tensor":
        return payload
    scale = q.scale.contiguous().view(torch.uint8).view(batch, payload.shape[1], -1)
    return torch.cat([payload, scale], dim=-1)


def unpack(packed: torch.Tensor, like: Quantized) -> Quantized:
    """The cast `pack` sent, as `like` (this rank's chunk) is laid out."""
    k = like.payload.shape[-1]
    payload = rows(packed[..., :k]).view(like.payload.dtype)
    if like.operand.granularity == "tensor":
        return Quantized(payload, like.scale, like.operand)
    scale = rows(packed[..., k:].contiguous()).view(torch.float32)
    return Quantized(payload, scale, like.operand)


@dataclass(frozen=True)
class Fp8:
    """fp8 operands by `recipe` (megatronish.fp8.gemm): each GEMM casts its operands, the
    scales of tensors split over split's groups reduced over them, so every layout computes the
    same; the output in the input's dtype."""

    recipe: Recipe
    fp8_gemms = True
    chunked_weight_grad = False  # the scales over the tokens need the whole tensors

    def linear(self, x, weight, bias, split: Split) -> torch.Tensor:
        """x W^T + b, x in autocast's dtype."""
        return add_bias(fp8_linear(to_autocast_dtype(x), weight, self.recipe, split), bias)

    def forward(self, x, weight, bias, split: Split) -> tuple[torch.Tensor, Any]:
        """(x W^T + b, the forward's scales that backward reuses)."""
        out, scales = forward_gemm(rows(x), weight, self.recipe, split)
        return add_bias(out.view(*x.shape[:-1], -1), bias), scales

    def grad_input(self, grad, weight, split: Split, state: Any) -> tuple[torch.Tensor, Any]:
        """(grad W, the scales the weight gradient reuses)."""
        out, scales = grad_input_gemm(rows(grad), weight, self.recipe, split, state)
        return out.view(*grad.shape[:-1], -1), scales

    def grad_weight(self, grad_rows, x_rows, weight, split: Split, state: Any) -> torch.Tensor:
        """grad^T x in weight's dtype."""
        return grad_weight_gemm(grad_rows, x_rows, self.recipe, split, state).to(weight.dtype)

    # The decomposed schedules' steps (megatronish.layers.formats).

    def ring_carries_cast(self, keep_gathered: bool) -> bool:
        """Whether the forward all-gather ring carries the input's fp8 cast (else the input
        itself, each rank casting each chunk as it arrives): a tensorwise cast always; a
        per-token one unless the gathered input is kept for the weight gradient, whose
        per-feature scales need the input (one gather of it rather than the cast forward and
        the input again backward)."""
        return self.recipe.input.granularity == "tensor" or not keep_gathered

    def operands(self, x, weights: Sequence, split: Split, gathered: bool) -> tuple:
        """(x [b, s, in] cast, each weight's casts, each weight's Scales); gathered: x is a
        sequence chunk of the input the ring gathers (its tensorwise scale the whole's)."""
        tokens = split.cp | TP if gathered else None
        qx, qws = forward_casts(rows(x), list(weights), self.recipe, split, tokens)
        return qx, qws, [Scales(input=tensorwise(qx), weight=tensorwise(qw[0])) for qw in qws]

    def block(self, qx: Quantized, index: int, parts: int, like: torch.Tensor) -> Quantized:
        """Sequence chunk `index` of `parts` of a cast of `like` [b, s, ...]."""
        return _block(qx, like.shape[0], index, parts)

    def send(self, qx: Quantized, x: torch.Tensor, keep_gathered: bool) -> torch.Tensor:
        """What the all-gather ring carries of this rank's chunk x and its cast qx."""
        return pack(qx, x.shape[0]) if self.ring_carries_cast(keep_gathered) else x

    def received(self, sent, qx: Quantized, split: Split, keep_gathered: bool) -> Quantized:
        """The cast of a chunk another rank `send`s, like this rank's qx."""
        if self.ring_carries_cast(keep_gathered):
            return unpack(sent, qx)
        cast = Cast(rows(sent), self.recipe.input, scale=tensorwise(qx))
        return quantize([cast], self.recipe.power_of_2_scales, split, self.recipe.backend)[0]

    def chunk_linear(self, qx, qws, bias, split: Split, like: torch.Tensor) -> torch.Tensor:
        """A chunk's x W^T + b [b, c, out] in like's dtype."""
        out = forward_product(qx, qws, split, self.recipe, like.dtype)
        return add_bias(seq(out, like.shape[0]), bias)

    def again(self, sent: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What backward gathers again of this rank's chunk: the tensorwise cast's payload that
        was sent, else x (the per-feature scales of the weight gradient need it)."""
        return sent if self.recipe.input.granularity == "tensor" else x

    def grad_operands(self, grads, weights, split: Split, states, gathered: bool = False):
        """Each output gradient [b, s, out] and its weight cast for the input-gradient GEMM,
        with the Scales the weight gradient reuses; gathered: the gradient is a sequence chunk
        of one the ring gathers (its tensorwise scale the whole's)."""
        tokens = split.cp | TP if gathered else None
        return [
            grad_input_casts(rows(grad), weight, self.recipe, split, state, tokens)
            for grad, weight, state in zip(grads, weights, states)
        ]

    def grad_block(self, casts, index: int, parts: int, like: torch.Tensor) -> torch.Tensor:
        """Sequence chunk `index` of `parts` of the sum over grad_operands of grad W [b, c, in],
        in like's (an output gradient's) dtype."""
        batch = like.shape[0]
        blocks = [_block(qdy, batch, index, parts) for qdys, _, _ in casts for qdy in qdys]
        qwts = [qwt for _, weight_casts, _ in casts for qwt in weight_casts]
        return seq(summed_product(blocks, qwts, like.dtype, self.recipe.backend), batch)

    def grad_received(self, grad, casts, split: Split) -> Any:
        """grad_operands of another rank's chunk of the gradient whose own chunk `casts` holds
        (the gathered gradient's tensorwise scale)."""
        (mine,), qwts, scales = casts[0]
        cast = Cast(rows(grad), self.recipe.grad_output, scale=scales.grad_output)
        (qdy,) = quantize([cast], self.recipe.power_of_2_scales, split, self.recipe.backend)
        return [([qdy], qwts, scales)]

    def grad_weight_of(self, grad, gathered, weight, split: Split, casts) -> torch.Tensor:
        """grad [b, s, out]^T times the gathered input [b, s, in], in weight's dtype: `again`'s
        or the kept chunks, gathered (the tensorwise payload stands for X^T cast)."""
        _, _, scales = casts
        if self.recipe.input.granularity != "tensor":
            return self.grad_weight(rows(grad), rows(gathered), weight, split, scales)
        payload = rows(gathered).view(self.recipe.input.dtype).t()  # [in, T], as X.t()
        x_t = Quantized(payload, scales.input, self.recipe.input)
        dw = grad_weight_gemm(rows(grad), None, self.recipe, split, scales, x_t=x_t)
        return dw.to(weight.dtype)

    # Bytes, for the accounting.

    def wire_bytes(self, tokens: int, k: int, width: int, keep_gathered: bool) -> int:
        """Bytes the forward all-gather ring carries of a [tokens, k] input of `width` bytes a
        value: its cast as ``pack`` sends it (the payload, a byte a value, and the float32
        scales of its layout: rowwise one a token, blockwise a 1 x 128 tile's each, tensorwise
        none, every rank holding that scale) or the input itself."""
        if not self.ring_carries_cast(keep_gathered):
            return tokens * k * width
        granularity, payload = self.recipe.input.granularity, self.recipe.input.dtype.itemsize
        scales = 0 if granularity == "tensor" else prod(layout((tokens, k), granularity))
        return tokens * k * payload + SCALE_BYTES * scales

    def again_bytes(self, tokens: int, k: int, width: int) -> int:
        """Bytes of what backward gathers again of a [tokens, k] input (``again``)."""
        return tokens * k * (1 if self.recipe.input.granularity == "tensor" else width)

    def cast_bytes(self, m: int, n: int, k: int, width: int, backward: bool) -> int:
        """Bytes the casts of one [m, k] x [k, n] GEMM move, each computing its amax as it goes:
        forward the input (read `width`, write 1) and the fp32 weight (read 4, write 1);
        backward the output gradient (read `width`, write it and its transpose, 1 each) and the
        transposed copies of the fp8 input and weight the gradient GEMMs read (read 1, write 1
        each)."""
        if backward:
            return m * n * (width + 2) + 2 * m * k + 2 * k * n
        return m * k * (width + 1) + 5 * k * n
