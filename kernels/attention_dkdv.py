"""The dK/dV kernel of the attention backward (attention_bwd.py launches it).

One program per (key block, batch * kv head). It keeps dk, dv for its keys in fp32 registers and
walks the query blocks of every query head of its group, so the GQA sum over the group happens
in registers: no atomics, no races, deterministic. For each head it walks three query ranges:
the band across the diagonal (causal only, masked), the blocks that need no mask, and the
masked tail; under document masks (DOCS) each range is cut to the query blocks that hold
queries of its keys' documents (attention_tiles.segment_bounds), and pairs of different
documents are masked. Under a sliding window (WINDOW) every range ends at the last query whose
window reaches the block's last key, the query blocks not wholly inside the windows of all its
keys move from the mask-free range to the masked tail, and the pairs outside the window are
masked. Shapes and formulas as in attention_bwd.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_tiles import load_rows


@triton.jit
def _dkdv_inner(
    dk,
    dk_rest,
    dv,
    k,
    k_rest,
    v,
    k_seg,
    Q,
    DO,
    LSE,
    DELTA,
    QSEG,
    seg_base,
    offs_n,
    offs_m,
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
    BLOCK_M: tl.constexpr,
    PREC: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < seq_len
        q = load_rows(Q, rows, row_ok, HEAD_DIM + QK_REST, 0, HEAD_DIM, MASKED)
        if QK_REST > 0:
            q_rest = load_rows(Q, rows, row_ok, HEAD_DIM + QK_REST, HEAD_DIM, QK_REST, MASKED)
        do = load_rows(DO, rows, row_ok, V_DIM, 0, V_DIM, MASKED)
        if MASKED:
            lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
        else:
            lse = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        # Transposed tiles [BLOCK_N keys, BLOCK_M queries], so dk and dv need no transpose.
        scores_t = tl.dot(k, tl.trans(q), input_precision=PREC)
        if QK_REST > 0:
            scores_t = tl.dot(k_rest, tl.trans(q_rest), scores_t, input_precision=PREC)
        if SOFTCAP:  # t = tanh(s / c); the capped scores c t, d(c t)/ds = 1 - t^2
            scores_t = 2.0 * tl.sigmoid(scores_t * cap_in) - 1.0
        p_t = tl.exp2(scores_t * qk_scale - lse[None, :])
        if MASKED:
            valid = row_ok[None, :] & (offs_n < seq_len)[:, None]
            if CAUSAL:
                valid = valid & (rows[None, :] >= offs_n[:, None])
            if WINDOW:
                valid = valid & (rows[None, :] + offset - offs_n[:, None] < window)
            p_t = tl.where(valid, p_t, 0.0)
        if DOCS:
            q_seg = tl.load(QSEG + seg_base + rows, mask=rows < seq_len, other=-1)
            p_t = tl.where(k_seg[:, None] == q_seg[None, :], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
        if SOFTCAP:  # ds's factor 1 - t^2 folded into p now, so t need not stay live
            p_t = p_t * (1.0 - scores_t * scores_t)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
        if QK_REST > 0:
            dk_rest += tl.dot(ds_t.to(q.dtype), q_rest, input_precision=PREC)
    return dk, dk_rest, dv


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
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
    start_n = tl.program_id(0) * BLOCK_N
    kv_bh = tl.program_id(1)
    n_kv = n_head // group
    first_head = (kv_bh // n_kv) * n_head + (kv_bh % n_kv) * group  # its group's first q head
    QK_DIM = HEAD_DIM + QK_REST
    k_base = kv_bh.to(tl.int64) * seq_len * QK_DIM
    v_base = kv_bh.to(tl.int64) * seq_len * V_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    col_ok = offs_n < seq_len
    k = load_rows(K + k_base, offs_n, col_ok, QK_DIM, 0, HEAD_DIM, True)
    v = load_rows(V + v_base, offs_n, col_ok, V_DIM, 0, V_DIM, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, V_DIM], dtype=tl.float32)
    k_rest, dk_rest = k, dk  # the query-key dims past HEAD_DIM, where there are any
    if QK_REST > 0:
        k_rest = load_rows(K + k_base, offs_n, col_ok, QK_DIM, HEAD_DIM, QK_REST, True)
        dk_rest = tl.zeros([BLOCK_N, QK_REST], dtype=tl.float32)

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
    if WINDOW:  # the queries whose windows reach these keys: i + offset - j < window
        # Queries from `reach` on see none of these keys; the query blocks below `inside` see
        # all of them.
        reach = tl.maximum(start_n + BLOCK_N - 1 + window - offset, 0)
        inside = (tl.maximum(start_n + window - offset, 0) // BLOCK_M) * BLOCK_M
        diag_hi = tl.minimum(diag_hi, reach)
        mid_hi = tl.minimum(mid_hi, tl.maximum(inside, mid_lo))
        tail_lo, tail_hi = tl.maximum(mid_lo, mid_hi), tl.minimum(tail_hi, reach)
    for g in range(group):
        bh = (first_head + g).to(tl.int64)
        Qh, DOh = Q + bh * seq_len * QK_DIM, DO + bh * seq_len * V_DIM
        LSEh, DELTAh = LSE + bh * seq_len, DELTA + bh * seq_len
        dk, dk_rest, dv = _dkdv_inner(
            dk,
            dk_rest,
            dv,
            k,
            k_rest,
            v,
            k_seg,
            Qh,
            DOh,
            LSEh,
            DELTAh,
            QSEG,
            seg_base,
            offs_n,
            offs_m,
            lo,
            diag_hi,
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
            BLOCK_M,
            PREC,
        )
        dk, dk_rest, dv = _dkdv_inner(
            dk,
            dk_rest,
            dv,
            k,
            k_rest,
            v,
            k_seg,
            Qh,
            DOh,
            LSEh,
            DELTAh,
            QSEG,
            seg_base,
            offs_n,
            offs_m,
            mid_lo,
            mid_hi,
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
            BLOCK_M,
            PREC,
        )
        dk, dk_rest, dv = _dkdv_inner(
            dk,
            dk_rest,
            dv,
            k,
            k_rest,
            v,
            k_seg,
            Qh,
            DOh,
            LSEh,
            DELTAh,
            QSEG,
            seg_base,
            offs_n,
            offs_m,
            tail_lo,
            tail_hi,
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
            BLOCK_M,
            PREC,
        )
    mask = col_ok[:, None]
    dk_offs = offs_n[:, None] * QK_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(DK + k_base + dk_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    if QK_REST > 0:
        dk_offs = offs_n[:, None] * QK_DIM + HEAD_DIM + tl.arange(0, QK_REST)[None, :]
        tl.store(DK + k_base + dk_offs, (dk_rest * sm_scale).to(DK.dtype.element_ty), mask=mask)
    dv_offs = offs_n[:, None] * V_DIM + tl.arange(0, V_DIM)[None, :]
    tl.store(DV + v_base + dv_offs, dv.to(DV.dtype.element_ty), mask=mask)
