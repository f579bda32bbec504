"""The fp8 launches of one training step (train.precision: fp8) for compile_check: for each
linear layer that runs in fp8 (the attention's fused query-key-value and output projections,
the dense MLP's up, gate and down projections; MoE layers stay out), the casts and GEMMs of
its forward, input gradient and weight gradient under each recipe, at one tensor-parallel
rank's shapes. Only for GPUs with fp8 tensor cores (sm_89 and newer): none for sm_80.

The casts read the activations and output gradients in the run's dtype and the weights in
fp32 (the master weights), the weight-gradient operands as transposed views; the GEMMs write
the run's dtype. The tensorwise and rowwise GEMMs run on torch._scaled_mm where it takes the
shapes, on the same GEMM kernel otherwise (its launches are the blockwise ones with other
scale strides, which specialize alike).
"""

from __future__ import annotations

import torch

from ._utils import Launch
from .fp8_cast import amax_launch, cast_launch, scale_shape
from .fp8_gemm import fp8_gemm_launch

FP8_CAPABILITY = 89
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def linear_shapes(m) -> list[tuple[int, int]]:
    """(out, in) of this rank's fp8 linear layers of model shapes m (compile_check.ModelShapes)."""
    attention = m.n_head * (m.v_head_dim or m.head_dim)  # the output projection's input
    qkv = (m.n_head + 2 * m.n_kv_head) * m.head_dim
    shapes = [(qkv, m.d_model), (m.d_model, attention)]
    if not m.experts:
        up = [(m.d_ff, m.d_model)] * (1 if m.family == "gpt2" else 2)  # gated: gate and up
        shapes += [*up, (m.d_model, m.d_ff)]
    return list(dict.fromkeys(shapes))


def _casts(tokens, out, d_in, dtype, granularity, fp8) -> list[Launch]:
    """The six casts of a linear layer's three GEMMs at one granularity (row: rowwise; tile and
    block: blockwise; tensor: tensorwise, each tensor's scale computed once and reused)."""
    weight_granularity = "block" if granularity == "tile" else granularity
    x, dy = _meta(tokens, d_in, dtype=dtype), _meta(tokens, out, dtype=dtype)
    weight = _meta(out, d_in, dtype=torch.float32)
    grad_fp8 = E5M2 if granularity == "tensor" else fp8
    operands = [  # (tensor, granularity, fp8 dtype, reused scale)
        (x, granularity, fp8, False),
        (weight, weight_granularity, fp8, False),
        (dy, granularity, grad_fp8, False),
        (weight.t(), weight_granularity, fp8, granularity == "tensor"),
        (dy.t(), granularity, grad_fp8, granularity == "tensor"),
        (x.t(), granularity, fp8, granularity == "tensor"),
    ]
    launches = []
    one = _meta(1, dtype=torch.float32)
    for tensor, group, fp8_dtype, reused in operands:
        rows, k = tensor.shape
        q = _meta(rows, k, dtype=fp8_dtype)
        scale = _meta(*scale_shape(group, rows, k), dtype=torch.float32)
        if group == "tensor" and not reused:
            launches.append(amax_launch(tensor, one))
        source = "scale" if reused else "amax" if group == "tensor" else "compute"
        power_of_2 = group == "row"  # the rowwise recipe's
        launches.append(cast_launch(tensor, q, one, scale, group, source, power_of_2))
    return launches


def _blockwise_gemms(tokens, out, d_in, dtype) -> list[Launch]:
    """Forward (x tiles, weight blocks), input gradient (dy tiles, the transposed weight's
    blocks) and weight gradient (dy^T and x^T tiles along the tokens)."""
    launches = []
    for (m, n, k), b_block in (
        ((tokens, out, d_in), True),
        ((tokens, d_in, out), True),
        ((out, d_in, tokens), False),
    ):
        kb = -(-k // 128)
        sa = _meta(m, kb, dtype=torch.float32)
        sb = _meta(-(-n // 128) if b_block else n, kb, dtype=torch.float32)
        a, b = _meta(m, k, dtype=E4M3), _meta(n, k, dtype=E4M3)
        launches.append(fp8_gemm_launch(a, b, sa, sb, _meta(m, n, dtype=dtype), b_block))
    return launches


def fp8_launches(m, dtype: torch.dtype, arch: int) -> list[Launch]:
    """Every fp8 launch of a training step of model shapes m in dtype on arch (none below
    sm_89): per linear layer the casts of the three recipes and the blockwise GEMMs. The
    column-parallel layers see the whole sequence (gathered under sequence parallelism)."""
    if arch < FP8_CAPABILITY:
        return []
    tokens = m.batch * m.seq_len
    launches = []
    for out, d_in in linear_shapes(m):
        for granularity in ("tensor", "row", "tile"):
            launches += _casts(tokens, out, d_in, dtype, granularity, E4M3)
        launches += _blockwise_gemms(tokens, out, d_in, dtype)
    return launches
