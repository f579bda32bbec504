"""Backward of the fused attention in attention.py: delta preprocess, dK/dV kernel, dQ kernel.

Its tiles come from attention_tiles.py; nothing here imports the forward module.

Shapes (as in attention.py): q, o, do, dq [b, n_head, s, d]; k, v, dk, dv [b, n_kv, s, d];
lse, delta [b, n_head, s] fp32 (lse in base 2). group = n_head / n_kv query heads per kv head.

With p = softmax(q k^T * scale) recomputed from lse, and delta_i = sum_d o_id do_id:
    dv = p^T do,   ds = p * (do v^T - delta),   dq = scale * ds k,   dk = scale * ds^T q.

1. _delta_kernel: delta per query row.
2. _dkdv_kernel: one program per (key block, batch * kv head). It keeps dk, dv for its keys in
   fp32 registers and walks the query blocks of every query head of its group, so the GQA sum
   over the group happens in registers: no atomics, no races, deterministic.
3. _dq_kernel: one program per (query block, batch * head); it walks the key blocks.
Both recompute p from q, k and lse; query/key blocks that need no mask run without one.
Under document masks (DOCS) both also mask the pairs of different documents, and walk only the
blocks that hold pairs of the same documents (attention_tiles.segment_bounds: the query range
of each key block for dK/dV, the key range of each query block for dQ).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._utils import LOG2_E, Launch, device_arch, dot_precision
from .attention_tiles import attention_blocks, query_block_keys, segment_bounds


@triton.jit
def _delta_kernel(O, DO, DELTA, n_rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (rows < n_rows)[:, None]
    offs = rows[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=rows < n_rows)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, k_seg, Q, DO, LSE, DELTA, QSEG, seg_base, offs_n, offs_m, offs_d, lo, hi,
    seq_len, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q_offs = rows[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            row_ok = rows < seq_len
            q = tl.load(Q + q_offs, mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + q_offs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
        else:
            q = tl.load(Q + q_offs)
            do = tl.load(DO + q_offs)
            lse = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        # Transposed tiles [BLOCK_N keys, BLOCK_M queries], so dk and dv need no transpose.
        p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])
        if MASKED:
            valid = row_ok[None, :] & (offs_n < seq_len)[:, None]
            if CAUSAL:
                valid = valid & (rows[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, p_t, 0.0)
        if DOCS:
            q_seg = tl.load(QSEG + seg_base + rows, mask=rows < seq_len, other=-1)
            p_t = tl.where(k_seg[:, None] == q_seg[None, :], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QSEG, KSEG, BOUNDS, seq_len, n_head, group, qk_scale,
    sm_scale, CAUSAL: tl.constexpr, DOCS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    kv_bh = tl.program_id(1)
    n_kv = n_head // group
    first_head = (kv_bh // n_kv) * n_head + (kv_bh % n_kv) * group  # its group's first q head
    kv_base = kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_offs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    col_ok = (offs_n < seq_len)[:, None]
    k = tl.load(K + kv_base + kv_offs, mask=col_ok, other=0.0)
    v = tl.load(V + kv_base + kv_offs, mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Query ranges: [lo, diag_hi) straddles the diagonal (causal only, masked); [mid_lo, mid_hi)
    # needs no mask (whole query blocks, whole key block, past the diagonal); [tail_lo, s) is
    # the masked tail. A key block that runs past s is handled entirely by the masked tail.
    full_m = (seq_len // BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = start_n
        diag_hi = tl.minimum(start_n + BLOCK_N, seq_len)
        mid_lo = start_n + BLOCK_N
    else:
        lo = 0
        diag_hi = 0
        mid_lo = 0
    mid_hi = tl.where(start_n + BLOCK_N <= seq_len, full_m, mid_lo)
    tail_lo = tl.maximum(mid_lo, mid_hi)
    tail_hi = seq_len
    k_seg = tl.zeros([BLOCK_N], dtype=tl.int32)  # one document unless DOCS
    seg_base = (kv_bh // n_kv).to(tl.int64) * seq_len  # this sequence's segments
    if DOCS:  # each range cut to the query blocks that hold queries of these keys' documents
        k_seg = tl.load(KSEG + seg_base + offs_n, mask=offs_n < seq_len, other=-2)
        bounds = BOUNDS + ((kv_bh // n_kv) * tl.num_programs(0) + tl.program_id(0)) * 2
        doc_lo = (tl.load(bounds) // BLOCK_M) * BLOCK_M
        doc_hi = tl.cdiv(tl.load(bounds + 1), BLOCK_M) * BLOCK_M
        lo, diag_hi = tl.maximum(lo, doc_lo), tl.minimum(diag_hi, doc_hi)
        mid_lo, mid_hi = tl.maximum(mid_lo, doc_lo), tl.minimum(mid_hi, doc_hi)
        tail_lo, tail_hi = tl.maximum(tail_lo, doc_lo), tl.minimum(tail_hi, doc_hi)
    for g in range(group):
        bh = (first_head + g).to(tl.int64)
        Qh, DOh = Q + bh * seq_len * HEAD_DIM, DO + bh * seq_len * HEAD_DIM
        LSEh, DELTAh = LSE + bh * seq_len, DELTA + bh * seq_len
        dk, dv = _dkdv_inner(
            dk, dv, k, v, k_seg, Qh, DOh, LSEh, DELTAh, QSEG, seg_base, offs_n, offs_m, offs_d,
            lo, diag_hi, seq_len, qk_scale, True, CAUSAL, DOCS, HEAD_DIM, BLOCK_M, PREC,
        )  # fmt: skip
        dk, dv = _dkdv_inner(
            dk, dv, k, v, k_seg, Qh, DOh, LSEh, DELTAh, QSEG, seg_base, offs_n, offs_m, offs_d,
            mid_lo, mid_hi, seq_len, qk_scale, False, CAUSAL, DOCS, HEAD_DIM, BLOCK_M, PREC,
        )  # fmt: skip
        dk, dv = _dkdv_inner(
            dk, dv, k, v, k_seg, Qh, DOh, LSEh, DELTAh, QSEG, seg_base, offs_n, offs_m, offs_d,
            tail_lo, tail_hi, seq_len, qk_scale, True, CAUSAL, DOCS, HEAD_DIM, BLOCK_M, PREC,
        )  # fmt: skip
    tl.store(DK + kv_base + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + kv_base + kv_offs, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, q_seg, K, V, KSEG, seg_base, offs_m, offs_n, offs_d, lo, hi,
    seq_len, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_offs = cols[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv_offs, mask=(cols < seq_len)[:, None], other=0.0)
            v = tl.load(V + kv_offs, mask=(cols < seq_len)[:, None], other=0.0)
        else:
            k = tl.load(K + kv_offs)
            v = tl.load(V + kv_offs)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
        if MASKED:
            valid = (cols < seq_len)[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        if DOCS:
            k_seg = tl.load(KSEG + seg_base + cols, mask=cols < seq_len, other=-1)
            p = tl.where(q_seg[:, None] == k_seg[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QSEG, KSEG, BOUNDS, seq_len, n_head, group, qk_scale,
    sm_scale, CAUSAL: tl.constexpr, DOCS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    # Causal: the last query blocks have the most keys; launch them first (as the forward).
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    start_m = block_m * BLOCK_M
    bh = tl.program_id(1)
    kv_bh = (bh // n_head) * (n_head // group) + (bh % n_head) // group
    q_base = bh.to(tl.int64) * seq_len * HEAD_DIM
    kv_base = kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_base + q_offs, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_base + q_offs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, free_hi, masked_lo, hi, q_seg, seg_base = query_block_keys(
        QSEG, BOUNDS, offs_m, row_ok, start_m, block_m, bh, seq_len, n_head, CAUSAL, DOCS,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    Kh, Vh = K + kv_base, V + kv_base
    dq = _dq_inner(
        dq, q, do, lse, delta, q_seg, Kh, Vh, KSEG, seg_base, offs_m, offs_n, offs_d, lo,
        free_hi, seq_len, qk_scale, False, CAUSAL, DOCS, HEAD_DIM, BLOCK_N, PREC,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse, delta, q_seg, Kh, Vh, KSEG, seg_base, offs_m, offs_n, offs_d, masked_lo,
        hi, seq_len, qk_scale, True, CAUSAL, DOCS, HEAD_DIM, BLOCK_N, PREC,
    )  # fmt: skip
    tl.store(DQ + q_base + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def backward_launches(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    causal: bool,
    arch: int,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[Launch]:
    """The three launches of the backward, in order (delta, dK/dV, dQ), on contiguous q, k, v,
    out, dout and the base-2 lse, into delta [b, n_head, s] fp32 and grads = (dq, dk, dv), with
    the tiles attention_blocks picks for GPU arch `arch` (device_arch); with segments (the
    queries' and the keys', contiguous int32 [b, s]) under document masks."""
    b, n_head, seq_len, head_dim = q.shape
    n_kv = k.shape[1]
    blocks = attention_blocks(seq_len, head_dim, q.dtype, arch)
    dq, dk, dv = grads
    n_rows = b * n_head * seq_len
    rows_per_program = 32 if head_dim >= 128 else 64
    delta_launch = Launch(
        _delta_kernel,
        grid=(triton.cdiv(n_rows, rows_per_program),),
        args=(out, dout, delta, n_rows),
        constexprs=dict(HEAD_DIM=head_dim, BLOCK=rows_per_program),
    )
    sm_scale = 1.0 / math.sqrt(head_dim)
    scalars = (seq_len, n_head, n_head // n_kv, sm_scale * LOG2_E, sm_scale)
    common = dict(
        CAUSAL=causal, DOCS=segments is not None, HEAD_DIM=head_dim, PREC=dot_precision(q.dtype)
    )
    dkdv, dq_tile = blocks.dkdv, blocks.dq
    dkdv_docs = dq_docs = (None, None, None)
    if segments is not None:  # dK/dV: the queries of each key block; dQ: the keys of each query
        q_seg, k_seg = segments
        dkdv_docs = (q_seg, k_seg, segment_bounds(k_seg, q_seg, dkdv.block_n))
        dq_docs = (q_seg, k_seg, segment_bounds(q_seg, k_seg, dq_tile.block_m))
    return [
        delta_launch,
        Launch(
            _dkdv_kernel,
            grid=(triton.cdiv(seq_len, dkdv.block_n), b * n_kv),
            args=(q, k, v, dout, lse, delta, dk, dv, *dkdv_docs, *scalars),
            constexprs=dict(BLOCK_M=dkdv.block_m, BLOCK_N=dkdv.block_n, **common),
            num_warps=dkdv.num_warps,
            num_stages=blocks.num_stages,
        ),
        Launch(
            _dq_kernel,
            grid=(triton.cdiv(seq_len, dq_tile.block_m), b * n_head),
            args=(q, k, v, dout, lse, delta, dq, *dq_docs, *scalars),
            constexprs=dict(BLOCK_M=dq_tile.block_m, BLOCK_N=dq_tile.block_n, **common),
            num_warps=dq_tile.num_warps,
            num_stages=blocks.num_stages,
        ),
    ]


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [b, n_head, s, d], dk and dv [b, n_kv, s, d] in the inputs' dtype, from the saved
    contiguous q, k, v, out, the base-2 lse [b, n_head, s] and the output gradient dout (and
    the checked segments under document masks)."""
    dout = dout.contiguous()
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if q.numel() == 0:
        return grads
    delta = torch.empty_like(lse)
    arch = device_arch(q.device)
    launches = backward_launches(q, k, v, out, lse, dout, delta, grads, causal, arch, segments)
    for launch in launches:
        launch.run()
    return grads
