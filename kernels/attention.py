"""Fused scaled-dot-product attention, FlashAttention-2 style: the forward kernel and its launch.

Shapes: b batch, n_head query heads, n_kv key/value heads (n_head % n_kv == 0; query head
h reads kv head h // (n_head / n_kv)), s sequence (queries and keys alike), d query-key head
dim, dv value head dim (attention_tiles: d a power of two 16..128, or one plus a smaller
power-of-two rest, as DeepSeek's 192 = 128 + 64; dv a power of two 16..128). q [b, n_head, s,
d], k [b, n_kv, s, d], v [b, n_kv, s, dv], o [b, n_head, s, dv]; scale 1/sqrt(d) unless
given; lse [b, n_head, s] fp32 in base 2: lse = log2(sum_j 2^(s_j * log2(e))) with the scores
s_j = q.k_j * scale, or c tanh(q.k_j * scale / c) under a soft-cap c (SOFTCAP), and with
sinks (HAS_SINKS) one more term 2^(sink * log2(e)) per row, which gives no value. With
HAS_ROW_MAX the forward also writes row_max [b, n_head, s] fp32: each row's largest score
s_j (natural units; -inf for a row that sees no key), QK-clip's record.

Forward: one program per (BLOCK_M queries, batch * head). It walks the key blocks with an online
softmax (running max m, running sum l, fp32 accumulator), so no s x s matrix exists. Key
blocks that need no mask (all keys valid, none past the diagonal) run first without one; the
rest (the diagonal band when causal, the sequence tail) run with the mask. The tiles are
chosen in attention_tiles.py; the backward kernels are in attention_bwd.py and
attention_dkdv.py; the autograd function joining both is attention_autograd.py; one block of
ring attention runs both through attention_ring.py.

Document masks (DOCS, segments [b, s] of the queries and of the keys): every key block also
masks the keys of other documents, and a query block walks only the key blocks that hold keys
of its documents (attention_tiles.segment_bounds), so a sequence packed with short documents
costs a fraction of causal attention. A row may then see no key in a block, or in a whole ring
block: the softmax runs from a finite reference, and such a row's output is 0 with lse -inf.

Sliding window (WINDOW: query i sees key j only when (i + offset) - j < window,
attention_tiles): a query block walks only the key blocks within reach of its rows' windows,
with the window's mask on the blocks its edge crosses, so attention over a window W costs
about s W instead of s^2 / 2 pairs. It combines with the causal and document masks, and a row
may see no key in a block (or in a ring block) as under document masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, device_arch, dot_precision
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
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    q_rest,
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
        if SOFTCAP:  # c tanh(s / c) = c (2 sigmoid(2 s / c) - 1); qk_scale carries c
            scores = 2.0 * tl.sigmoid(scores * cap_in) - 1.0
        scores = scores * qk_scale  # [M, N], log2 units
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            if WINDOW:
                valid = valid & (offs_m[:, None] + offset - cols[None, :] < window)
            scores = tl.where(valid, scores, float("-inf"))
        if DOCS:
            k_seg = tl.load(KSEG + seg_base + cols, mask=col_ok, other=-1)
            scores = tl.where(q_seg[:, None] == k_seg[None, :], scores, float("-inf"))
        # Without documents or a window key 0 is in the first block every row sees, so m_new
        # is finite from the first step; with them a row may have seen no key yet (m_new -inf).
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = m_new
        if DOCS or WINDOW:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    QSEG,
    KSEG,
    BOUNDS,
    SINKS,
    ROW_MAX,
    seq_len,
    n_head,
    group,
    qk_scale,
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
    HAS_SINKS: tl.constexpr,
    HAS_ROW_MAX: tl.constexpr,
):
    # Causal: the last query blocks have the most keys; launch them first for a balanced tail.
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    start_m = block_m * BLOCK_M
    bh = tl.program_id(1)
    kv_bh = (bh // n_head) * (n_head // group) + (bh % n_head) // group
    QK_DIM = HEAD_DIM + QK_REST
    q_base = bh.to(tl.int64) * seq_len * QK_DIM
    k_base = kv_bh.to(tl.int64) * seq_len * QK_DIM
    v_base = kv_bh.to(tl.int64) * seq_len * V_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_mask = offs_m < seq_len
    q = load_rows(Q + q_base, offs_m, row_mask, QK_DIM, 0, HEAD_DIM, True)
    q_rest = q  # the query-key dims past HEAD_DIM, where there are any (QK_REST > 0)
    if QK_REST > 0:
        q_rest = load_rows(
            Q + q_base, offs_m, row_mask, HEAD_DIM + QK_REST, HEAD_DIM, QK_REST, True
        )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
    lo, band_hi, free_hi, masked_lo, hi, q_seg, seg_base = query_block_keys(
        QSEG,
        BOUNDS,
        offs_m,
        row_mask,
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
    Kh, Vh = K + k_base, V + v_base
    if WINDOW:  # the key blocks the window's edge crosses
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            q_rest,
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
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        q_rest,
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
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        q_rest,
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
    if HAS_ROW_MAX:  # each row's largest score, natural units (a row that saw no key: -inf)
        row_offs = bh.to(tl.int64) * seq_len + offs_m
        tl.store(ROW_MAX + row_offs, m_i * 0.6931471805599453, mask=row_mask)
    if DOCS or WINDOW:  # a row that saw no key (m_i -inf): output 0, lse -inf
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    lse = m_i + tl.log2(l_i)
    if HAS_SINKS:  # the head's sink (base 2) joins the denominator: lse' = logaddexp2(lse, sink)
        sink = tl.load(SINKS + bh % n_head)
        top = tl.maximum(lse, sink)
        lse_all = top + tl.log2(tl.exp2(lse - top) + tl.exp2(sink - top))
        out = out * tl.exp2(lse - lse_all)[:, None]
        lse = lse_all
    o_offs = offs_m[:, None] * V_DIM + tl.arange(0, V_DIM)[None, :]
    o_base = bh.to(tl.int64) * seq_len * V_DIM
    tl.store(O + o_base + o_offs, out.to(O.dtype.element_ty), mask=row_mask[:, None])
    tl.store(LSE + bh.to(tl.int64) * seq_len + offs_m, lse, mask=row_mask)


def forward_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    arch: int,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    offset: int = 0,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    row_max: torch.Tensor | None = None,
) -> Launch:
    """The forward kernel's launch on contiguous q, k, v into out (any float dtype) and the
    base-2 lse, with the tiles attention_blocks picks for GPU arch `arch` (device_arch); with
    segments (the queries' and the keys', contiguous int32 [b, s]) under document masks; with
    a sliding window (None: none) over queries `offset` positions after the keys; scale and
    softcap as attention_tiles.score_args takes them; sinks: fp32 [n_head] in base 2 (a sink
    times log2(e)), joined to every row's lse, or None; row_max: fp32 [b, n_head, s] that gets
    each row's largest score (natural units, after any soft-cap; QK-clip's record), or None."""
    b, n_head, seq_len, head_dim = q.shape
    first, rest = split_qk_dim(head_dim)
    blocks = attention_blocks(seq_len, head_dim, q.dtype, arch, v.shape[-1], softcap is not None)
    tile = blocks.fwd
    windowed, window, offset = window_args(window, offset, seq_len)
    capped, _, qk_scale, cap_in = score_args(head_dim, scale, softcap)
    scalars = (seq_len, n_head, n_head // k.shape[1], qk_scale, cap_in, window, offset)
    docs = (None, None, None)
    if segments is not None:
        docs = (*segments, segment_bounds(segments[0], segments[1], tile.block_m))
    constexprs = dict(
        CAUSAL=causal,
        DOCS=segments is not None,
        WINDOW=windowed,
        SOFTCAP=capped,
        HEAD_DIM=first,
        QK_REST=rest,
        V_DIM=v.shape[-1],
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        PREC=dot_precision(q.dtype),
        HAS_SINKS=sinks is not None,
        HAS_ROW_MAX=row_max is not None,
    )
    return Launch(
        _attn_fwd_kernel,
        grid=(triton.cdiv(seq_len, tile.block_m), b * n_head),
        args=(q, k, v, out, lse, *docs, sinks, row_max, *scalars),
        constexprs=constexprs,
        num_warps=tile.num_warps,
        num_stages=blocks.num_stages,
    )


def forward_pass(
    q,
    k,
    v,
    causal: bool,
    segments,
    out_dtype=None,
    window=None,
    offset: int = 0,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    row_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, n_head, s, dv] in out_dtype (default q's), base-2 lse [b, n_head, s] fp32) of
    contiguous q, k, v (and segments, checked, or None; a sliding window or None; scale,
    softcap, base-2 sinks and row_max as forward_launch takes them)."""
    b, n_head, seq_len, _ = q.shape
    out = q.new_empty(b, n_head, seq_len, v.shape[-1], dtype=out_dtype or q.dtype)
    lse = torch.empty(b, n_head, seq_len, device=q.device, dtype=torch.float32)
    if out.numel() > 0:
        arch = device_arch(q.device)
        options = dict(scale=scale, softcap=softcap, sinks=sinks, row_max=row_max)
        forward_launch(q, k, v, out, lse, causal, arch, segments, window, offset, **options).run()
    return out, lse
