"""Backward of the fused attention in attention.py: delta preprocess, dK/dV kernel, dQ kernel.

Its tiles come from attention_tiles.py, its dK/dV kernel from attention_dkdv.py; nothing here
imports the forward module (attention_autograd.py runs both).

Shapes (as in attention.py): q, o, do, dq [b, n_head, s, d]; k, v, dk, dv [b, n_kv, s, d];
lse, delta [b, n_head, s] fp32 (lse in base 2). group = n_head / n_kv query heads per kv head.

With p = softmax(q k^T * scale) recomputed from lse, and delta_i = sum_d o_id do_id:
    dv = p^T do,   ds = p * (do v^T - delta),   dq = scale * ds k,   dk = scale * ds^T q.
Under a soft-cap (SOFTCAP) p comes from the capped scores c t, t = tanh(q k^T * scale / c), and
ds takes the cap's derivative 1 - t^2. Sinks sit in the lse (they give no value): nothing here.

1. _delta_kernel: delta per query row.
2. _dkdv_kernel (attention_dkdv.py): one program per (key block, batch * kv head); it sums
   over the query heads of its group in registers (no atomics, deterministic).
3. _dq_kernel: one program per (query block, batch * head); it walks the key blocks.
Both recompute p from q, k and lse; query/key blocks that need no mask run without one.
Under document masks (DOCS) both also mask the pairs of different documents, and walk only the
blocks that hold pairs of the same documents (attention_tiles.segment_bounds: the query range
of each key block for dK/dV, the key range of each query block for dQ). Under a sliding window
(WINDOW) both mask the pairs outside it and walk only the blocks within reach of it
(attention_tiles.query_block_keys for dQ, the dK/dV kernel's query ranges).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, dot_precision
from .attention_dkdv import _dkdv_kernel
from .attention_tiles import (
    attention_blocks,
    load_rows,
    query_block_keys,
    score_args,
    segment_bounds,
    split_qk_dim,
    window_args,
)


@triton.jit
def _delta_kernel(O, DO, DELTA, n_rows, V_DIM: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, V_DIM)
    mask = (rows < n_rows)[:, None]
    offs = rows[:, None] * V_DIM + offs_d[None, :]
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=rows < n_rows)


@triton.jit
def _dq_inner(
    dq,
    dq_rest,
    q,
    q_rest,
    do,
    lse,
    delta,
    q_seg,
    K,
    V,
    KSEG,
    seg_base,
    offs_m,
    offs_n,
    lo,
    hi,
    seq_len,
    qk_scale,
    cap_in,
    window,
    offset,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_REST: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < seq_len
        k = load_rows(K, cols, col_ok, HEAD_DIM + QK_REST, 0, HEAD_DIM, MASKED)
        if QK_REST > 0:
            k_rest = load_rows(K, cols, col_ok, HEAD_DIM + QK_REST, HEAD_DIM, QK_REST, MASKED)
        v = load_rows(V, cols, col_ok, V_DIM, 0, V_DIM, MASKED)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC)
        if QK_REST > 0:
            scores = tl.dot(q_rest, tl.trans(k_rest), scores, input_precision=PREC)
        if SOFTCAP:  # t = tanh(s / c); the capped scores c t, d(c t)/ds = 1 - t^2
            scores = 2.0 * tl.sigmoid(scores * cap_in) - 1.0
        p = tl.exp2(scores * qk_scale - lse[:, None])
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            if WINDOW:
                valid = valid & (offs_m[:, None] + offset - cols[None, :] < window)
            p = tl.where(valid, p, 0.0)
        if DOCS:
            k_seg = tl.load(KSEG + seg_base + cols, mask=col_ok, other=-1)
            p = tl.where(q_seg[:, None] == k_seg[None, :], p, 0.0)
        if SOFTCAP:  # ds's factor 1 - t^2 folded into p now, so t need not stay live
            p = p * (1.0 - scores * scores)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        if QK_REST > 0:
            dq_rest += tl.dot(ds.to(k.dtype), k_rest, input_precision=PREC)
    return dq, dq_rest


@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    QSEG,
    KSEG,
    BOUNDS,
    seq_len,
    n_head,
    group,
    qk_scale,
    sm_scale,
    cap_in,
    window,
    offset,
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QK_REST: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    # Causal: the last query blocks have the most keys; launch them first (as the forward).
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    start_m = block_m * BLOCK_M
    bh = tl.program_id(1)
    kv_bh = (bh // n_head) * (n_head // group) + (bh % n_head) // group
    QK_DIM = HEAD_DIM + QK_REST
    q_base = bh.to(tl.int64) * seq_len * QK_DIM
    do_base = bh.to(tl.int64) * seq_len * V_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < seq_len
    q = load_rows(Q + q_base, offs_m, row_ok, QK_DIM, 0, HEAD_DIM, True)
    do = load_rows(DO + do_base, offs_m, row_ok, V_DIM, 0, V_DIM, True)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q_rest, dq_rest = q, dq  # the query-key dims past HEAD_DIM, where there are any
    if QK_REST > 0:
        q_rest = load_rows(Q + q_base, offs_m, row_ok, QK_DIM, HEAD_DIM, QK_REST, True)
        dq_rest = tl.zeros([BLOCK_M, QK_REST], dtype=tl.float32)
    lo, band_hi, free_hi, masked_lo, hi, q_seg, seg_base = query_block_keys(
        QSEG,
        BOUNDS,
        offs_m,
        row_ok,
        start_m,
        block_m,
        bh,
        seq_len,
        n_head,
        window,
        offset,
        CAUSAL,
        DOCS,
        WINDOW,
        BLOCK_M,
        BLOCK_N,
    )
    Kh = K + kv_bh.to(tl.int64) * seq_len * QK_DIM
    Vh = V + kv_bh.to(tl.int64) * seq_len * V_DIM
    if WINDOW:  # the key blocks the window's edge crosses
        dq, dq_rest = _dq_inner(
            dq,
            dq_rest,
            q,
            q_rest,
            do,
            lse,
            delta,
            q_seg,
            Kh,
            Vh,
            KSEG,
            seg_base,
            offs_m,
            offs_n,
            lo,
            band_hi,
            seq_len,
            qk_scale,
            cap_in,
            window,
            offset,
            True,
            CAUSAL,
            DOCS,
            WINDOW,
            SOFTCAP,
            HEAD_DIM,
            QK_REST,
            V_DIM,
            BLOCK_N,
            PREC,
        )
    dq, dq_rest = _dq_inner(
        dq,
        dq_rest,
        q,
        q_rest,
        do,
        lse,
        delta,
        q_seg,
        Kh,
        Vh,
        KSEG,
        seg_base,
        offs_m,
        offs_n,
        band_hi,
        free_hi,
        seq_len,
        qk_scale,
        cap_in,
        window,
        offset,
        False,
        CAUSAL,
        DOCS,
        WINDOW,
        SOFTCAP,
        HEAD_DIM,
        QK_REST,
        V_DIM,
        BLOCK_N,
        PREC,
    )
    dq, dq_rest = _dq_inner(
        dq,
        dq_rest,
        q,
        q_rest,
        do,
        lse,
        delta,
        q_seg,
        Kh,
        Vh,
        KSEG,
        seg_base,
        offs_m,
        offs_n,
        masked_lo,
        hi,
        seq_len,
        qk_scale,
        cap_in,
        window,
        offset,
        True,
        CAUSAL,
        DOCS,
        WINDOW,
        SOFTCAP,
        HEAD_DIM,
        QK_REST,
        V_DIM,
        BLOCK_N,
        PREC,
    )
    dq_offs = offs_m[:, None] * QK_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(DQ + q_base + dq_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    if QK_REST > 0:
        dq_offs = offs_m[:, None] * QK_DIM + HEAD_DIM + tl.arange(0, QK_REST)[None, :]
        dq_rest = (dq_rest * sm_scale).to(DQ.dtype.element_ty)
        tl.store(DQ + q_base + dq_offs, dq_rest, mask=row_ok[:, None])


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
    window: int | None = None,
    offset: int = 0,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> list[Launch]:
    """The three launches of the backward, in order (delta, dK/dV, dQ), on contiguous q, k, v,
    out, dout and the base-2 lse, into delta [b, n_head, s] fp32 and grads = (dq, dk, dv), with
    the tiles attention_blocks picks for GPU arch `arch` (device_arch); with segments (the
    queries' and the keys', contiguous int32 [b, s]) under document masks; with a sliding
    window (None: none) over queries `offset` positions after the keys; scale and softcap as
    attention_tiles.score_args takes them. Sinks need nothing here: the lse holds them."""
    b, n_head, seq_len, head_dim = q.shape
    n_kv, v_dim = k.shape[1], v.shape[-1]
    first, rest = split_qk_dim(head_dim)
    blocks = attention_blocks(seq_len, head_dim, q.dtype, arch, v_dim, softcap is not None)
    dq, dk, dv = grads
    n_rows = b * n_head * seq_len
    rows_per_program = 32 if v_dim >= 128 else 64
    delta_launch = Launch(
        _delta_kernel,
        grid=(triton.cdiv(n_rows, rows_per_program),),
        args=(out, dout, delta, n_rows),
        constexprs=dict(V_DIM=v_dim, BLOCK=rows_per_program),
    )
    capped, sm_scale, qk_scale, cap_in = score_args(head_dim, scale, softcap)
    windowed, window, offset = window_args(window, offset, seq_len)
    scalars = (seq_len, n_head, n_head // n_kv, qk_scale, sm_scale, cap_in, window, offset)
    common = dict(
        CAUSAL=causal,
        DOCS=segments is not None,
        WINDOW=windowed,
        SOFTCAP=capped,
        HEAD_DIM=first,
        QK_REST=rest,
        V_DIM=v_dim,
        PREC=dot_precision(q.dtype),
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
