"""The chunked gated delta rule's forward as Triton kernels, and its autograd Function.

The math is megatronish.ops.gated_delta's (its docstring has the chunk's terms). Shapes: q, k
[BH, s, d_k], v [BH, s, d_v], g and beta [BH, s], s a multiple of CHUNK (the caller pads with
zeros, which leave the state alone), d_k and d_v powers of two from 16 to 128. Three kernels:

1. prep (one program per chunk and head): G = cumsum g, A, T = (I + A)^-1 (forward
   substitution in 16 x 16 blocks, joined: _unit_lower_inverse), W = T diag(beta e^G) K and
   U = T diag(beta) V; saves G, T, W, U (fp32) for the other kernels and the backward.
2. state (one program per BV columns of the state and head, along the chunks in order): the
   state before each chunk (saved: H [BH, n, d_k, d_v] fp32), V' = U - W S (saved) and the next
   state; the last one is the final state.
3. output (one program per chunk, BV columns and head): O = scale (e^G Q S + lower(Q K^T * D)
   V').

Everything accumulates in fp32; the dots take fp32 operands, exact ("ieee") for fp32 inputs and
TF32 for bf16 ones (better than bf16 operands, still on tensor cores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device
from .gated_delta_bwd import (
    CHUNK,
    FORWARD_BLOCK_V,
    NUM_WARPS,
    backward_launches,
    block_v,
    precision,
)


@triton.jit
def _join_blocks(t, a, rows, WIDTH: tl.constexpr, PREC: tl.constexpr):
    """t, the inverse of I + a's diagonal blocks of WIDTH, made the inverse of its diagonal
    blocks of 2 WIDTH: [[T1, 0], [L, T2]]^-1 = T - T L T, L the block of a between them."""
    pair = (rows[:, None] // (2 * WIDTH)) == (rows[None, :] // (2 * WIDTH))
    across = pair & ((rows[:, None] // WIDTH) != (rows[None, :] // WIDTH))
    between = tl.dot(tl.where(across, a, 0.0), t, input_precision=PREC)
    return t - tl.dot(t, between, input_precision=PREC)


@triton.jit
def _unit_lower_inverse(a, rows, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower [CHUNK, CHUNK] (CHUNK = 64): forward substitution within
    the 16 x 16 diagonal blocks, all four at once (row i of each block is e_i - a_i T, rows in
    order: the triangular solve, stable where a series in a would not be), then the blocks
    joined in pairs twice (_join_blocks)."""
    sub = rows % 16
    t = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    in_block = (rows[:, None] // 16) == (rows[None, :] // 16)
    for i in range(1, 16):
        a_i = tl.where(in_block & (sub[:, None] == i), a, 0.0)
        t = tl.where(sub[:, None] == i, t - tl.dot(a_i, t, input_precision=PREC), t)
    t = _join_blocks(t, a, rows, 16, PREC)
    return _join_blocks(t, a, rows, 32, PREC)


@triton.jit
def _gdn_prep_kernel(
    K, V, G, BETA, GCUM, T_OUT, W, U, seq,
    DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_chunks = tl.num_programs(0)
    rows = tl.arange(0, CHUNK)
    tok = bh * seq + n * CHUNK + rows
    cols_k, cols_v = tl.arange(0, DK), tl.arange(0, DV)
    beta = tl.load(BETA + tok).to(tl.float32)
    cum = tl.cumsum(tl.load(G + tok).to(tl.float32), 0)
    tl.store(GCUM + tok, cum)
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    kk = tl.dot(k, tl.trans(k), input_precision=PREC)
    lower = rows[:, None] > rows[None, :]
    a = tl.where(
        lower, kk * beta[:, None] * tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0
    )
    t = _unit_lower_inverse(a, rows, PREC)
    tile = (bh * n_chunks + n) * CHUNK * CHUNK
    tl.store(T_OUT + tile + rows[:, None] * CHUNK + rows[None, :], t)
    k_scaled = k * (beta * tl.exp(cum))[:, None]
    w = tl.dot(t, k_scaled, input_precision=PREC)
    tl.store(W + tok[:, None] * DK + cols_k[None, :], w)
    v = tl.load(V + tok[:, None] * DV + cols_v[None, :]).to(tl.float32)
    u = tl.dot(t, v * beta[:, None], input_precision=PREC)
    tl.store(U + tok[:, None] * DV + cols_v[None, :], u)


@triton.jit
def _gdn_state_kernel(
    K, W, U, GCUM, S0, H, V_NEW, S_OUT, seq, n_chunks,
    HAS_S0: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    vb, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    cols_v = vb * BV + tl.arange(0, BV)
    state_at = cols_k[:, None] * DV + cols_v[None, :]
    if HAS_S0:
        s = tl.load(S0 + bh * DK * DV + state_at).to(tl.float32)
    else:
        s = tl.zeros([DK, BV], dtype=tl.float32)
    for n in range(n_chunks):
        tl.store(H + (bh * n_chunks + n) * DK * DV + state_at, s)
        tok = bh * seq + n * CHUNK + rows
        w = tl.load(W + tok[:, None] * DK + cols_k[None, :])
        u = tl.load(U + tok[:, None] * DV + cols_v[None, :])
        v_new = u - tl.dot(w, s, input_precision=PREC)
        tl.store(V_NEW + tok[:, None] * DV + cols_v[None, :], v_new)
        cum = tl.load(GCUM + tok)
        last = tl.load(GCUM + bh * seq + n * CHUNK + CHUNK - 1)
        k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
        k_decayed = k * tl.exp(last - cum)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=PREC)
    tl.store(S_OUT + bh * DK * DV + state_at, s)


@triton.jit
def _gdn_out_kernel(
    Q, K, GCUM, H, V_NEW, O, seq, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    n, vb, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_chunks = tl.num_programs(0)
    rows, cols_k = tl.arange(0, CHUNK), tl.arange(0, DK)
    cols_v = vb * BV + tl.arange(0, BV)
    tok = bh * seq + n * CHUNK + rows
    cum = tl.load(GCUM + tok)
    q = tl.load(Q + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    k = tl.load(K + tok[:, None] * DK + cols_k[None, :]).to(tl.float32)
    lower = rows[:, None] >= rows[None, :]
    decay = tl.where(lower, tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * decay * scale
    s = tl.load(H + (bh * n_chunks + n) * DK * DV + cols_k[:, None] * DV + cols_v[None, :])
    v_new = tl.load(V_NEW + tok[:, None] * DV + cols_v[None, :])
    q_decayed = q * (tl.exp(cum) * scale)[:, None]
    o = tl.dot(q_decayed, s, input_precision=PREC) + tl.dot(scores, v_new, input_precision=PREC)
    tl.store(O + tok[:, None] * DV + cols_v[None, :], o.to(O.dtype.element_ty))


def prep_launch(k, v, g, beta, g_cum, t, w, u) -> Launch:
    """The prep kernel over k [BH, s, d_k], v [BH, s, d_v], g, beta [BH, s] into g_cum [BH, s],
    t [BH, n, CHUNK, CHUNK], w [BH, s, d_k] and u [BH, s, d_v] (fp32)."""
    bh, seq, dk = k.shape
    dims = dict(DK=dk, DV=v.shape[-1], CHUNK=CHUNK, PREC=precision(k.dtype))
    grid = (seq // CHUNK, bh)
    return Launch(_gdn_prep_kernel, grid, (k, v, g, beta, g_cum, t, w, u, seq), dims, NUM_WARPS, 1)


def state_launch(k, w, u, g_cum, s0, h, v_new, s_out) -> Launch:
    """The state kernel: h [BH, n, d_k, d_v] the state before each chunk, v_new [BH, s, d_v],
    s_out [BH, d_k, d_v] (fp32); s0 the initial state or None (zeros)."""
    bh, seq, dk = k.shape
    dv = u.shape[-1]
    bv = block_v(dv, FORWARD_BLOCK_V)
    args = (k, w, u, g_cum, s0 if s0 is not None else s_out, h, v_new, s_out, seq, seq // CHUNK)
    dims = dict(HAS_S0=s0 is not None, DK=dk, DV=dv, BV=bv, CHUNK=CHUNK, PREC=precision(k.dtype))
    return Launch(_gdn_state_kernel, (dv // bv, bh), args, dims, NUM_WARPS, 1)


def out_launch(q, k, g_cum, h, v_new, o, scale: float) -> Launch:
    """The output kernel into o [BH, s, d_v] (the inputs' dtype)."""
    bh, seq, dk = q.shape
    dv = o.shape[-1]
    bv = block_v(dv, FORWARD_BLOCK_V)
    dims = dict(DK=dk, DV=dv, BV=bv, CHUNK=CHUNK, PREC=precision(q.dtype))
    grid = (seq // CHUNK, dv // bv, bh)
    return Launch(_gdn_out_kernel, grid, (q, k, g_cum, h, v_new, o, seq, scale), dims, NUM_WARPS, 1)


def forward_launches(q, k, v, g, beta, s0, scale: float, saved: dict, o, s_out) -> list[Launch]:
    """The three forward launches, with the fp32 intermediates in `saved` (g_cum, t, w, u, h,
    v_new), which the backward reads."""
    return [
        prep_launch(k, v, g, beta, saved["g_cum"], saved["t"], saved["w"], saved["u"]),
        state_launch(
            k, saved["w"], saved["u"], saved["g_cum"], s0, saved["h"], saved["v_new"], s_out
        ),  # fmt: skip
        out_launch(q, k, saved["g_cum"], saved["h"], saved["v_new"], o, scale),
    ]


def intermediates(q: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward's fp32 intermediates for q [BH, s, d_k] and v [BH, s, d_v] (any device,
    meta included)."""
    bh, seq, dk = q.shape
    dv, n = v.shape[-1], seq // CHUNK
    new = dict(dtype=torch.float32, device=q.device)
    return dict(
        g_cum=torch.empty(bh, seq, **new),
        t=torch.empty(bh, n, CHUNK, CHUNK, **new),
        w=torch.empty(bh, seq, dk, **new),
        u=torch.empty(bh, seq, dv, **new),
        h=torch.empty(bh, n, dk, dv, **new),
        v_new=torch.empty(bh, seq, dv, **new),
    )


class _GatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, s0, scale):
        saved = intermediates(q, v)
        o = torch.empty_like(v)
        s_out = torch.empty(q.shape[0], q.shape[-1], v.shape[-1], dtype=torch.float32,
                            device=q.device)  # fmt: skip
        for launch in forward_launches(q, k, v, g, beta, s0, scale, saved, o, s_out):
            launch.run()
        names = list(saved)
        ctx.save_for_backward(q, k, v, g, beta, *saved.values())
        ctx.names, ctx.scale, ctx.has_s0 = names, scale, s0 is not None
        return o, s_out

    @staticmethod
    def backward(ctx, do, ds_out):
        q, k, v, g, beta, *rest = ctx.saved_tensors
        saved = dict(zip(ctx.names, rest, strict=True))
        do = do.contiguous()
        ds_out = None if ds_out is None else ds_out.float().contiguous()
        grads = dict(
            dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
            dg=torch.empty_like(g, dtype=torch.float32),
            dbeta=torch.empty_like(beta, dtype=torch.float32),
            ds0=torch.empty(q.shape[0], q.shape[-1], v.shape[-1], dtype=torch.float32,
                            device=q.device),
        )  # fmt: skip
        for launch in backward_launches(q, k, v, beta, do, ds_out, saved, grads, ctx.scale):
            launch.run()
        ds0 = grads["ds0"] if ctx.has_s0 else None
        dg, dbeta = grads["dg"].to(g.dtype), grads["dbeta"].to(beta.dtype)
        return grads["dq"], grads["dk"], grads["dv"], dg, dbeta, ds0, None


def gated_delta_rule(q, k, v, g, beta, scale: float, initial_state=None):
    """(o [b, h, s, d_v] in v's dtype, final state [b, h, d_k, d_v] fp32) of the gated delta
    rule (megatronish.ops.gated_delta: q and k already per value head), by the kernels, any
    sequence length (padded to whole chunks with zeros here); autograd-capable."""
    check_device(q, k, v, g, beta, initial_state)
    b, heads, seq, dk = q.shape
    dv, pad = v.shape[-1], -seq % CHUNK

    def flat(x, width):
        x = x.reshape(b * heads, seq, *([width] if width else []))
        if pad:
            x = torch.cat([x, x.new_zeros(b * heads, pad, *([width] if width else []))], 1)
        return x.contiguous()

    args = (flat(q, dk), flat(k, dk), flat(v, dv), flat(g, 0), flat(beta, 0))
    s0 = None if initial_state is None else initial_state.reshape(b * heads, dk, dv).contiguous()
    o, state = _GatedDelta.apply(*args, s0, scale)
    return o[:, :seq].reshape(b, heads, seq, dv), state.reshape(b, heads, dk, dv)
