"""The chunked gated delta rule's backward as Triton kernels (gated_delta.py's forward).

Within a chunk (gated_delta.py's terms; S the state before it, S' after it, dS' its gradient,
R = diag(beta) V - diag(beta e^G) K S, so V' = T R; f = e^(G_last - G)):

    dV' = P^T dO + diag(f) K dS'                     (P = scale lower(Q K^T * D))
    dS  = e^G_last dS' + scale (e^G Q)^T dO - W^T dV'
    dQ  = scale diag(e^G) dO S^T + dQK K,   dQK = scale lower(dO V'^T * D)
    dR  = T^T dV',  dT = dV' R^T,  dA = -strict_lower(T^T dT T^T)
    dV  = diag(beta) dR
    dK  = dQK^T Q + diag(f) V' dS'^T - diag(beta e^G) dR S^T + B K + B^T K,  B = diag(beta) (dA * D)
    dbeta = rowsum(V * dR) - e^G rowsum(K * dR S^T) + rowsum(dA * K K^T * D)
    dG  = the gradient of every exp above; dg = its reverse cumulative sum within the chunk.

Six kernels, in order (each a function of the shapes only, none atomic): dv_intra (per chunk,
BV columns and head: P^T dO into dV'); state (per BV columns and head, along the chunks
backwards: the gradient of the state after each chunk, saved as DH, dV' completed, and dS of the
initial state); dq (per chunk and head: dQ, the P part of dK and of dG, over the state's columns
in BV steps); dr (per chunk and head: dR, saved, dV, dT, saved, the V part of dbeta and
e^G_last's part of dG); dk_state (per chunk and head: the parts of dK, dbeta and dG through the
states, V' dS'^T and dR S^T); dk (per chunk and head: dA and its parts of dK, dbeta and dG, then
dg). Split so because one kernel holding all of a chunk's [64, 128] tiles spills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch

CHUNK = 64
# Columns of the state (of d_v) per program, or per step of a program's loop: the forward's
# and the backward's (whose kernels hold more), and the warps of every kernel; with these no
# kernel spills registers at d_k = d_v = 128 in bf16 on sm_80 or sm_90 (kernel_report).
FORWARD_BLOCK_V, BACKWARD_BLOCK_V, NUM_WARPS = 64, 32, 8


def precision(dtype: torch.dtype) -> str:
    """The dots' input precision: exact fp32 for fp32 inputs, TF32 for 16-bit ones."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decay(cum, rows, STRICT: tl.constexpr):
    """exp(G_i - G_j) on and below the diagonal (strictly below: STRICT), 0 above."""
    if STRICT:
        keep = rows[:, None] > rows[None, :]
    else:
        keep = rows[:, None] >= rows[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, cum[:, None] - cum[None, :], 0.0)), 0.0)


@triton.jit
def _kkd(K, tok, cols_k, cum, rows, DK: tl.constexpr, PREC: tl.constexpr):
    """K K^T * D strictly below the diagonal, for the chunk's tokens tok."""
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    return tl.dot(k, tl.trans(k), input_precision=PREC) * _decay(cum, rows, True)


@triton.jit
def _gdn_dv_intra_kernel(
    Q, K, GCUM, DO, DV_NEW, seq, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    n, vb, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    cols_v = vb * BV + tl.arange(0, BV)
    tok = bh * seq + n * CHUNK + rows
    cum = tl.load(GCUM + tok)
    q = tl.load(Q + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * _decay(cum, rows, False) * scale
    do = tl.load(DO + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
    dv_new = tl.dot(tl.trans(scores), do, input_precision=PREC)
    tl.store(DV_NEW + tok[:, None] * DV + cols_v[None, :], dv_new)


@triton.jit
def _gdn_state_bwd_kernel(
    Q, K, W, GCUM, DO, DS_OUT, DH, DV_NEW, DS0, seq, n_chunks, scale,
    HAS_DS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    vb, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    cols_v = vb * BV + tl.arange(0, BV)
    state_at = cols_k[:, None] * DV + cols_v[None, :]
    if HAS_DS:
        ds = tl.load(DS_OUT + bh * DK * DV + state_at)
    else:
        ds = tl.zeros([DK, BV], dtype=tl.float32)
    for back in range(n_chunks):
        n = n_chunks - 1 - back
        tl.store(DH + (bh * n_chunks + n) * DK * DV + state_at, ds)
        tok = bh * seq + n * CHUNK + rows
        cum = tl.load(GCUM + tok)
        last = tl.load(GCUM + bh * seq + n * CHUNK + CHUNK - 1)
        k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
        k_decayed = k * tl.exp(last - cum)[:, None]
        dv_new = tl.load(DV_NEW + tok[:, None] * DV + cols_v[None, :])  # P^T dO so far
        dv_new += tl.dot(k_decayed, ds, input_precision=PREC)
        tl.store(DV_NEW + tok[:, None] * DV + cols_v[None, :], dv_new)
        q = tl.load(Q + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
        q_decayed = q * (tl.exp(cum) * scale)[:, None]
        do = tl.load(DO + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
        ds = ds * tl.exp(last) + tl.dot(tl.trans(q_decayed), do, input_precision=PREC)
        w = tl.load(W + tok[:, None] * DK + cols_k[None, :])
        ds -= tl.dot(tl.trans(w), dv_new, input_precision=PREC)
    tl.store(DS0 + bh * DK * DV + state_at, ds)


@triton.jit
def _gdn_dq_kernel(
    Q, K, GCUM, H, V_NEW, DO, DQ, DK_PART, DG_PART, seq, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_chunks = tl.num_programs(0)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    tok = bh * seq + n * CHUNK + rows
    dp = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dO V'^T, first: the intra-chunk part
    for v0 in range(0, DV, BV):
        cols_v = v0 + tl.arange(0, BV)
        do = tl.load(DO + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
        v_new = tl.load(V_NEW + tok[:, None] * DV + cols_v[None, :])
        dp += tl.dot(do, tl.trans(v_new), input_precision=PREC)
    cum = tl.load(GCUM + tok)
    dqk = dp * _decay(cum, rows, False) * scale
    q = tl.load(Q + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    dp_p = dqk * tl.dot(q, tl.trans(k), input_precision=PREC)  # dP * P, through D
    dg = tl.sum(dp_p, axis=1) - tl.sum(dp_p, axis=0)
    tl.store(DK_PART + tok[:, None] * DK + cols_k[None, :],
             tl.dot(tl.trans(dqk), q, input_precision=PREC))  # fmt: skip
    dq_intra = tl.dot(dqk, k, input_precision=PREC)
    dq = tl.zeros([CHUNK, DK], dtype=tl.float32)  # then dO S^T, the inter-chunk part
    for v0 in range(0, DV, BV):
        cols_v = v0 + tl.arange(0, BV)
        s = tl.load(H + (bh * n_chunks + n) * DK * DV + cols_k[:, None] * DV + cols_v[None, :])
        do = tl.load(DO + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
        dq += tl.dot(do, tl.trans(s), input_precision=PREC)
    dq = dq * (tl.exp(cum) * scale)[:, None]
    q = tl.load(Q + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    tl.store(DG_PART + tok, dg + tl.sum(q * dq, axis=1))  # through e^G of the inter part
    tl.store(DQ + tok[:, None] * DK + cols_k[None, :], (dq + dq_intra).to(DQ.dtype.element_ty))


@triton.jit
def _gdn_dk_state_kernel(
    K, BETA, GCUM, H, DH, V_NEW, DR, DK_PART, DG_PART, DBETA, seq,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_chunks = tl.num_programs(0)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    tok = bh * seq + n * CHUNK + rows
    state = (bh * n_chunks + n) * DK * DV
    cum = tl.load(GCUM + tok)
    last = tl.load(GCUM + bh * seq + n * CHUNK + CHUNK - 1)
    f = tl.exp(last - cum)
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    vds = tl.zeros([CHUNK, DK], dtype=tl.float32)  # V' dS'^T
    drs = tl.zeros([CHUNK, DK], dtype=tl.float32)  # dR S^T
    for v0 in range(0, DV, BV):
        cols_v = v0 + tl.arange(0, BV)
        s_at = state + cols_k[:, None] * DV + cols_v[None, :]
        v_new = tl.load(V_NEW + tok[:, None] * DV + cols_v[None, :])
        vds += tl.dot(v_new, tl.trans(tl.load(DH + s_at)), input_precision=PREC)
        dr = tl.load(DR + tok[:, None] * DV + cols_v[None, :])
        drs += tl.dot(dr, tl.trans(tl.load(H + s_at)), input_precision=PREC)
    e = tl.exp(cum)
    beta_e = tl.load(BETA + tok).to(tl.float32) * e
    dk_at = DK_PART + tok[:, None] * DK + cols_k[None, :]
    tl.store(dk_at, tl.load(dk_at) + vds * f[:, None] - drs * beta_e[:, None])
    k_dkv = f * tl.sum(k * vds, axis=1)  # the gradient through f = e^(G_last - G)
    k_drs = tl.sum(k * drs, axis=1)  # through beta e^G
    tl.store(DBETA + tok, tl.load(DBETA + tok) - e * k_drs)
    dg = tl.load(DG_PART + tok) - k_dkv - beta_e * k_drs
    tl.store(DG_PART + tok, dg + tl.where(rows == CHUNK - 1, tl.sum(k_dkv, axis=0), 0.0))


@triton.jit
def _gdn_dr_kernel(
    K, V, BETA, GCUM, T, H, DH, V_NEW, DV_NEW, DG_PART, DT, DR, DV_OUT, DBETA, seq,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_chunks = tl.num_programs(0)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    tok = bh * seq + n * CHUNK + rows
    state = (bh * n_chunks + n) * DK * DV
    tile = (bh * n_chunks + n) * CHUNK * CHUNK + rows[:, None] * CHUNK + rows[None, :]
    cum = tl.load(GCUM + tok)
    last = tl.load(GCUM + bh * seq + n * CHUNK + CHUNK - 1)
    beta = tl.load(BETA + tok).to(tl.float32)
    t = tl.load(T + tile)
    a = _kkd(K, tok, cols_k, cum, rows, DK, PREC) * beta[:, None]  # A = T^-1 - I: R = V' + A V'
    dt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    dbeta = tl.zeros([CHUNK], dtype=tl.float32)
    dlast = 0.0  # sum(dS' * S), through e^G_last
    for v0 in range(0, DV, BV):
        cols_v = v0 + tl.arange(0, BV)
        s_at = state + cols_k[:, None] * DV + cols_v[None, :]
        s, ds = tl.load(H + s_at), tl.load(DH + s_at)
        v = tl.load(V + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
        v_new = tl.load(V_NEW + tok[:, None] * DV + cols_v[None, :])
        dv_new = tl.load(DV_NEW + tok[:, None] * DV + cols_v[None, :])
        r = v_new + tl.dot(a, v_new, input_precision=PREC)
        dr = tl.dot(tl.trans(t), dv_new, input_precision=PREC)
        tl.store(DR + tok[:, None] * DV + cols_v[None, :], dr)
        tl.store(DV_OUT + tok[:, None] * DV + cols_v[None, :], (dr * beta[:, None]).to(
            DV_OUT.dtype.element_ty))  # fmt: skip
        dbeta += tl.sum(v * dr, axis=1)
        dt += tl.dot(dv_new, tl.trans(r), input_precision=PREC)
        dlast += tl.sum(tl.sum(ds * s, axis=1), axis=0)
    tl.store(DT + tile, dt)
    tl.store(DBETA + tok, dbeta)
    dg = tl.load(DG_PART + tok)
    tl.store(DG_PART + tok, dg + tl.where(rows == CHUNK - 1, tl.exp(last) * dlast, 0.0))


@triton.jit
def _gdn_dk_kernel(
    K, BETA, GCUM, T, DT, DK_PART, DG_PART, DK_OUT, DBETA, DG, seq,
    DK: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_chunks = tl.num_programs(0)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    tok = bh * seq + n * CHUNK + rows
    tile = (bh * n_chunks + n) * CHUNK * CHUNK + rows[:, None] * CHUNK + rows[None, :]
    cum = tl.load(GCUM + tok)
    beta = tl.load(BETA + tok).to(tl.float32)
    t_t = tl.trans(tl.load(T + tile))
    da = tl.dot(tl.dot(t_t, tl.load(DT + tile), input_precision=PREC), t_t, input_precision=PREC)
    da = tl.where(rows[:, None] > rows[None, :], -da, 0.0)
    kkd = _kkd(K, tok, cols_k, cum, rows, DK, PREC)
    da_a = da * kkd * beta[:, None]  # dA * A, through D
    tl.store(DBETA + tok, tl.load(DBETA + tok) + tl.sum(da * kkd, axis=1))
    b = da * _decay(cum, rows, True) * beta[:, None]
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    dk = tl.load(DK_PART + tok[:, None] * DK + cols_k[None, :])
    dk += tl.dot(b, k, input_precision=PREC) + tl.dot(tl.trans(b), k, input_precision=PREC)
    tl.store(DK_OUT + tok[:, None] * DK + cols_k[None, :], dk.to(DK_OUT.dtype.element_ty))
    dg = tl.load(DG_PART + tok) + tl.sum(da_a, axis=1) - tl.sum(da_a, axis=0)
    # g -> G = cumsum g: dg_i = sum over j >= i of dG_j.
    tl.store(DG + tok, tl.sum(dg, axis=0) - tl.cumsum(dg, 0) + dg)


def block_v(dv: int, widest: int) -> int:
    """Columns of the state per program, or per step of a program's loop: widest at most."""
    return min(dv, widest)


def backward_launches(q, k, v, beta, do, ds_out, saved: dict, grads: dict, scale: float):
    """The three backward launches over the forward's inputs ([BH, s, ...]), do [BH, s, d_v],
    ds_out (the final state's gradient, fp32, or None) and the forward's saved intermediates
    (gated_delta.intermediates) into grads: dq, dk, dv (the inputs' dtypes), dg, dbeta and ds0
    (fp32). The partial dK, dG and the gradients of the states and V' are fp32 scratch."""
    bh, seq, dk = q.shape
    dv = v.shape[-1]
    bv, n = block_v(dv, BACKWARD_BLOCK_V), seq // CHUNK
    dims = dict(DK=dk, DV=dv, BV=bv, CHUNK=CHUNK, PREC=precision(q.dtype))
    new = dict(dtype=torch.float32, device=q.device)
    dh, dv_new = torch.empty_like(saved["h"]), torch.empty_like(saved["v_new"])
    dk_part, dg_part = torch.empty(bh, seq, dk, **new), torch.empty(bh, seq, **new)
    g_cum, h, v_new = saved["g_cum"], saved["h"], saved["v_new"]
    state_args = (q, k, saved["w"], g_cum, do, ds_out if ds_out is not None else grads["ds0"],
                  dh, dv_new, grads["ds0"], seq, n, scale)  # fmt: skip
    dq_args = (q, k, g_cum, h, v_new, do, grads["dq"], dk_part, dg_part, seq, scale)
    dt = torch.empty_like(saved["t"])
    dr = torch.empty_like(v_new)
    dr_args = (k, v, beta, g_cum, saved["t"], h, dh, v_new, dv_new, dg_part, dt, dr,
               grads["dv"], grads["dbeta"], seq)  # fmt: skip
    dk_state_args = (k, beta, g_cum, h, dh, v_new, dr, dk_part, dg_part, grads["dbeta"], seq)
    dk_args = (k, beta, g_cum, saved["t"], dt, dk_part, dg_part, grads["dk"], grads["dbeta"],
               grads["dg"], seq)  # fmt: skip
    intra = (q, k, g_cum, do, dv_new, seq, scale)
    return [
        Launch(_gdn_dv_intra_kernel, (n, dv // bv, bh), intra, dims, NUM_WARPS, 1),
        Launch(
            _gdn_state_bwd_kernel,
            (dv // bv, bh),
            state_args,
            dict(HAS_DS=ds_out is not None, **dims),
            NUM_WARPS,
            1,
        ),  # fmt: skip
        Launch(_gdn_dq_kernel, (n, bh), dq_args, dims, NUM_WARPS, 1),
        Launch(_gdn_dr_kernel, (n, bh), dr_args, dims, NUM_WARPS, 1),
        Launch(_gdn_dk_state_kernel, (n, bh), dk_state_args, dims, NUM_WARPS, 1),
        Launch(
            _gdn_dk_kernel,
            (n, bh),
            dk_args,
            dict(DK=dk, CHUNK=CHUNK, PREC=dims["PREC"]),
            NUM_WARPS,
            1,
        ),  # fmt: skip
    ]
