"""A linear layer's numeric format: how it casts its operands and runs its three GEMMs, on the
plain layer (megatronish.layers.linear: linear, forward, grad_input, grad_weight) and on each
chunk of the decomposed schedules (megatronish.layers.overlap: ring_carries_cast, operands,
block, send, received, chunk_linear, again, grad_operands, grad_block, grad_received,
grad_weight_of), and the bytes its casts move, which the accounting asks (wire_bytes,
again_bytes, cast_bytes). HighPrecision here: the autocast precision, torch's GEMMs;
Fp8(recipe): megatronish.layers.fp8_format. A new format is one more class with these methods
(and its choice in megatronish.layers.plan.numeric_format).

Shapes: x [..., in], weight [out, in], grad [..., out]; `rows` operands are [tokens, features];
the schedules' tensors [b, s, ...], a sequence chunk [b, c, ...].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from megatronish.fp8 import Split


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype when autocast is on for its device (else x): cast before a
    collective, so activations and their gradients cross the wire in bf16, not fp32."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as [rows, n]."""
    return x.reshape(-1, x.shape[-1])


def seq(t: torch.Tensor, batch: int) -> torch.Tensor:
    """t [b * c, n] as [b, c, n]."""
    return t.view(batch, -1, t.shape[-1])


def seq_block(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Sequence chunk `index` of `parts` of x [b, s, ...] (dim 1, a view)."""
    c = x.shape[1] // parts
    return x[:, index * c : (index + 1) * c]


class HighPrecision:
    """The autocast precision: torch's GEMMs, nothing cast, nothing reduced; the rings carry
    the activations and gradients themselves."""

    fp8_gemms = False
    chunked_weight_grad = True  # the schedules sum the weight gradient chunk by chunk

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

    # The decomposed schedules' steps: the operands are the tensors themselves.

    def ring_carries_cast(self, keep_gathered: bool) -> bool:
        """Whether the all-gather ring carries a cast of the input: never."""
        return False

    def operands(self, x, weights: Sequence, split: Split, gathered: bool) -> tuple:
        """(x's operand, each weight's, what backward needs of each weight's forward)."""
        return x, list(weights), [None] * len(weights)

    def block(self, x, index: int, parts: int, like: torch.Tensor) -> torch.Tensor:
        """Sequence chunk `index` of `parts` of an operand of `like` [b, s, ...]."""
        return seq_block(x, index, parts)

    def send(self, x_op, x: torch.Tensor, keep_gathered: bool) -> torch.Tensor:
        """What the all-gather ring carries of this rank's chunk x (its operand x_op)."""
        return x

    def received(self, sent, x_op, split: Split, keep_gathered: bool) -> torch.Tensor:
        """The operand of a chunk another rank `send`s."""
        return sent

    def chunk_linear(self, x, weight, bias, split: Split, like: torch.Tensor) -> torch.Tensor:
        """A chunk's x W^T + b [b, c, out]."""
        return F.linear(x, weight, bias)

    def again(self, sent: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What backward gathers again of this rank's chunk x (`sent`: what the ring carried)."""
        return x

    def grad_operands(self, grads, weights, split: Split, states, gathered: bool = False):
        """Per weight: (its output gradients' operands, its weight's for the input gradient,
        what the weight gradient needs of them)."""
        return [([grad.contiguous()], [weight], None) for grad, weight in zip(grads, weights)]

    def grad_block(self, casts, index: int, parts: int, like: torch.Tensor) -> torch.Tensor:
        """Sequence chunk `index` of `parts` of the sum over grad_operands of grad W [b, c, in],
        in like's (an output gradient's) dtype."""
        part = None
        for grads, weights, _ in casts:
            for grad, weight in zip(grads, weights):
                term = seq_block(grad, index, parts).matmul(weight.to(like.dtype))
                part = term if part is None else part.add_(term)
        return part

    def grad_received(self, grad, casts, split: Split) -> Any:
        """grad_operands of another rank's chunk of the gradient whose own chunk `casts` has."""
        return [([grad], casts[0][1], None)]

    def grad_weight_of(self, grad, gathered, weight, split: Split, casts) -> torch.Tensor:
        """grad [b, s, out]^T times the gathered input [b, s, in], in weight's dtype."""
        return self.grad_weight(rows(grad), rows(gathered), weight, split, None)

    # Bytes, for the accounting.

    def wire_bytes(self, tokens: int, k: int, width: int, keep_gathered: bool) -> int:
        """Bytes the forward all-gather ring carries of a [tokens, k] input of `width` bytes a
        value: the input."""
        return tokens * k * width

    def again_bytes(self, tokens: int, k: int, width: int) -> int:
        """Bytes of what backward gathers again of a [tokens, k] input: the input."""
        return tokens * k * width

    def cast_bytes(self, m: int, n: int, k: int, width: int, backward: bool) -> int:
        """Bytes the casts of one [m, k] x [k, n] GEMM move: none."""
        return 0


HIGH_PRECISION = HighPrecision()
