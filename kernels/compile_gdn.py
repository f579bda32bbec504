"""The gated delta rule's launches (Gated DeltaNet's linear attention) for compile_check: its
three forward and six backward kernels at one tensor-parallel rank's shapes, on meta tensors,
built by the launchers' own functions (gated_delta.forward_launches, gated_delta_bwd
.backward_launches), with an initial state and the final state's gradient (the
context-parallel chain's launches: the specializations without them differ only in that)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._utils import Launch
from .gated_delta import forward_launches, intermediates
from .gated_delta_bwd import backward_launches


@dataclass(frozen=True)
class GatedDeltaShapes:
    """What one rank of a model's linear-attention layer hands the kernels."""

    name: str  # e.g. "qwen3.5 linear attention tp1"
    batch: int
    seq_len: int  # a multiple of the chunk (64)
    heads: int  # value heads on this rank (query-key heads are repeated to them)
    k_head_dim: int
    v_head_dim: int


def gated_delta_launches(m: GatedDeltaShapes, dtype: torch.dtype) -> list[Launch]:
    """The forward's and backward's launches of shapes m with inputs in dtype."""
    bh, seq = m.batch * m.heads, m.seq_len

    def meta(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    q, k = meta(bh, seq, m.k_head_dim), meta(bh, seq, m.k_head_dim)
    v, g, beta = meta(bh, seq, m.v_head_dim), meta(bh, seq), meta(bh, seq)
    state = meta(bh, m.k_head_dim, m.v_head_dim, dtype=torch.float32)
    saved = intermediates(q, v)
    launches = forward_launches(q, k, v, g, beta, state, 0.1, saved, torch.empty_like(v), state)
    grads = dict(
        dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
        dg=meta(bh, seq, dtype=torch.float32), dbeta=meta(bh, seq, dtype=torch.float32),
        ds0=state,
    )  # fmt: skip
    return launches + backward_launches(q, k, v, beta, v, state, saved, grads, 0.1)
