"""The chunked gated delta rule's backward as Triton kernels (gated_delta.py's forward).

Within a chunk (gated_delta.py's terms; S the state before it, S' after it, dS' its gradient,
R = diag(beta) V - diag(beta e^G) K S, so V' = T R; f = e^(G_last - G)):

    dV' = P^T dO + diag(f) K dS'                     (P = scale lower(Q K^T * D))
    dS  = e^G_last dS' + scale (e^G Q)^T dO - W^T dV'
    dQ  = scale diag(e^G) dO S^T + dQK K,   dQK = scale lower(dO V'^T * D)
    dR  = T^T dV',  dT = dV' R^T,  dA = -strict_lower(T^T dT T^T)
    dV  = diag(beta) dR
    dK  = dQK^T Q + diag(f) V' dS'^T - diag(beta e^G) dR S^T + B K + B^T K,  B = dA * D diag(beta)
    dbeta = rowsum(V * dR) - e^G rowsum(K * dR S^T) + rowsum(dA * K K^T * D)
    dG  = the gradient of every exp above; dg = its reverse cumulative sum within the chunk.

Three kernels: state (one program per BV columns and head, along the chunks backwards: the
gradient of the state after each chunk, saved, dV' saved, and dS of the initial state); dq
(one program per chunk and head: dQ, the P part of dK and dG, over the state's columns in BV
blocks); dk (one program per chunk and head: dK, dV, dbeta, dg).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch

CHUNK = 64
BLOCK_V = 64  # columns of the state (of d_v) per program, or per step of a program's loop


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
        q = tl.load(Q + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
        k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * _decay(cum, rows, False) * scale
        do = tl.load(DO + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
        k_decayed = k * tl.exp(last - cum)[:, None]
        dv_new = tl.dot(tl.trans(scores), do, input_precision=PREC)
        dv_new += tl.dot(k_decayed, ds, input_precision=PREC)
        tl.store(DV_NEW + tok[:, None] * DV + cols_v[None, :], dv_new)
        w = tl.load(W + tok[:, None] * DK + cols_k[None, :])
        q_decayed = q * (tl.exp(cum) * scale)[:, None]
        ds = ds * tl.exp(last) + tl.dot(tl.trans(q_decayed), do, input_precision=PREC)
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
    dq = tl.zeros([CHUNK, DK], dtype=tl.float32)
    dp = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        cols_v = v0 + tl.arange(0, BV)
        s = tl.load(H + (bh * n_chunks + n) * DK * DV + cols_k[:, None] * DV + cols_v[None, :])
        do = tl.load(DO + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
        v_new = tl.load(V_NEW + tok[:, None] * DV + cols_v[None, :])
        dq += tl.dot(do, tl.trans(s), input_precision=PREC)
        dp += tl.dot(do, tl.trans(v_new), input_precision=PREC)
    cum = tl.load(GCUM + tok)
    q = tl.load(Q + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    dq = dq * (tl.exp(cum) * scale)[:, None]
    dg = tl.sum(q * dq, axis=1)  # through e^G of the inter-chunk term
    decay = _decay(cum, rows, False)
    dqk = dp * decay * scale
    dp_p = dqk * tl.dot(q, tl.trans(k), input_precision=PREC)  # dP * P, through D
    dg += tl.sum(dp_p, axis=1) - tl.sum(dp_p, axis=0)
    dq += tl.dot(dqk, k, input_precision=PREC)
    tl.store(DQ + tok[:, None] * DK + cols_k[None, :], dq.to(DQ.dtype.element_ty))
    dk = tl.dot(tl.trans(dqk), q, input_precision=PREC)
    tl.store(DK_PART + tok[:, None] * DK + cols_k[None, :], dk)
    tl.store(DG_PART + tok, dg)


@triton.jit
def _gdn_dk_kernel(
    K, V, BETA, GCUM, T, H, DH, V_NEW, DV_NEW, DK_PART, DG_PART, DK_OUT, DV_OUT, DBETA, DG,
    seq, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_chunks = tl.num_programs(0)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    tok = bh * seq + n * CHUNK + rows
    state = (bh * n_chunks + n) * DK * DV
    cum = tl.load(GCUM + tok)
    last = tl.load(GCUM + bh * seq + n * CHUNK + CHUNK - 1)
    beta = tl.load(BETA + tok).to(tl.float32)
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    t = tl.load(T + (bh * n_chunks + n) * CHUNK * CHUNK + rows[:, None] * CHUNK + rows[None, :])
    beta_e, f = beta * tl.exp(cum), tl.exp(last - cum)
    k_scaled = k * beta_e[:, None]
    dk = tl.zeros([CHUNK, DK], dtype=tl.float32)
    dt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    dbeta = tl.zeros([CHUNK], dtype=tl.float32)
    k_dkv = tl.zeros([CHUNK], dtype=tl.float32)  # rowsum(K * V' dS'^T), through f
    k_drs = tl.zeros([CHUNK], dtype=tl.float32)  # rowsum(K * dR S^T), through beta e^G
    dlast = 0.0  # sum(dS' * S), through e^G_last
    for v0 in range(0, DV, BV):
        cols_v = v0 + tl.arange(0, BV)
        s_at = state + cols_k[:, None] * DV + cols_v[None, :]
        s, ds = tl.load(H + s_at), tl.load(DH + s_at)
        v = tl.load(V + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
        v_new = tl.load(V_NEW + tok[:, None] * DV + cols_v[None, :])
        dv_new = tl.load(DV_NEW + tok[:, None] * DV + cols_v[None, :])
        r = v * beta[:, None] - tl.dot(k_scaled, s, input_precision=PREC)
        dr = tl.dot(tl.trans(t), dv_new, input_precision=PREC)
        tl.store(DV_OUT + tok[:, None] * DV + cols_v[None, :], (dr * beta[:, None]).to(
            DV_OUT.dtype.element_ty))  # fmt: skip
        dbeta += tl.sum(v * dr, axis=1)
        dt += tl.dot(dv_new, tl.trans(r), input_precision=PREC)
        dlast += tl.sum(tl.sum(ds * s, axis=1), axis=0)
        vds = tl.dot(v_new, tl.trans(ds), input_precision=PREC)
        drs = tl.dot(dr, tl.trans(s), input_precision=PREC)
        k_dkv += tl.sum(k * vds, axis=1)
        k_drs += tl.sum(k * drs, axis=1)
        dk += vds * f[:, None] - drs * beta_e[:, None]
    t_t = tl.trans(t)
    strict = rows[:, None] > rows[None, :]
    da = tl.dot(tl.dot(t_t, dt, input_precision=PREC), t_t, input_precision=PREC)
    da = tl.where(strict, -da, 0.0)
    kkd = tl.dot(k, tl.trans(k), input_precision=PREC) * _decay(cum, rows, True)
    da_a = da * kkd * beta[:, None]  # dA * A, through D
    dbeta += tl.sum(da * kkd, axis=1) - tl.exp(cum) * k_drs
    b = da * _decay(cum, rows, True) * beta[:, None]
    dk += tl.dot(b, k, input_precision=PREC) + tl.dot(tl.trans(b), k, input_precision=PREC)
    dk += tl.load(DK_PART + tok[:, None] * DK + cols_k[None, :])
    tl.store(DK_OUT + tok[:, None] * DK + cols_k[None, :], dk.to(DK_OUT.dtype.element_ty))
    tl.store(DBETA + tok, dbeta)
    dg = tl.load(DG_PART + tok) + tl.sum(da_a, axis=1) - tl.sum(da_a, axis=0)
    dg -= beta_e * k_drs + f * k_dkv
    dg += tl.where(rows == CHUNK - 1, tl.sum(f * k_dkv, axis=0) + tl.exp(last) * dlast, 0.0)
    # g -> G = cumsum g: dg_i = sum over j >= i of dG_j.
    tl.store(DG + tok, tl.sum(dg, axis=0) - tl.cumsum(dg, 0) + dg)


def block_v(dv: int) -> int:
    """Columns of the state (of d_v) per program, or per step of a program's loop."""
    return min(dv, BLOCK_V)


def backward_launches(q, k, v, beta, do, ds_out, saved: dict, grads: dict, scale: float):
    """The three backward launches over the forward's inputs ([BH, s, ...]), do [BH, s, d_v],
    ds_out (the final state's gradient, fp32, or None) and the forward's saved intermediates
    (gated_delta.intermediates) into grads: dq, dk, dv (the inputs' dtypes), dg, dbeta and ds0
    (fp32). The partial dK, dG and the gradients of the states and V' are fp32 scratch."""
    bh, seq, dk = q.shape
    dv = v.shape[-1]
    bv, n = block_v(dv), seq // CHUNK
    dims = dict(DK=dk, DV=dv, BV=bv, CHUNK=CHUNK, PREC=precision(q.dtype))
    new = dict(dtype=torch.float32, device=q.device)
    dh, dv_new = torch.empty_like(saved["h"]), torch.empty_like(saved["v_new"])
    dk_part, dg_part = torch.empty(bh, seq, dk, **new), torch.empty(bh, seq, **new)
    g_cum, h, v_new = saved["g_cum"], saved["h"], saved["v_new"]
    state_args = (q, k, saved["w"], g_cum, do, ds_out if ds_out is not None else grads["ds0"],
                  dh, dv_new, grads["ds0"], seq, n, scale)  # fmt: skip
    dq_args = (q, k, g_cum, h, v_new, do, grads["dq"], dk_part, dg_part, seq, scale)
    dk_args = (k, v, beta, g_cum, saved["t"], h, dh, v_new, dv_new, dk_part, dg_part,
               grads["dk"], grads["dv"], grads["dbeta"], grads["dg"], seq)  # fmt: skip
    return [
        Launch(_gdn_state_bwd_kernel, (dv // bv, bh), state_args,
               dict(HAS_DS=ds_out is not None, **dims), 4, 1),  # fmt: skip
        Launch(_gdn_dq_kernel, (n, bh), dq_args, dims, 4, 1),
        Launch(_gdn_dk_kernel, (n, bh), dk_args, dims, 4, 1),
    ]
