"""Fused scaled-dot-product attention, FlashAttention-2 style: forward kernel and autograd wrapper.

Shapes: b batch, n_head query heads, n_kv key/value heads (n_head % n_kv == 0; query head
h reads kv head h // (n_head / n_kv)), s sequence (queries and keys alike), d head dim (a
power of two, 16..128). q, o [b, n_head, s, d]; k, v [b, n_kv, s, d];
lse [b, n_head, s] fp32 in base 2: lse = log2(sum_j 2^(q.k_j * scale * log2(e))).

Forward: one program per (BLOCK_M queries, batch * head). It walks the key blocks with an online
softmax (running max m, running sum l, fp32 accumulator), so no s x s matrix exists. Key
blocks that need no mask (all keys valid, none past the diagonal) run first without one; the
rest (the diagonal band when causal, the sequence tail) run with the mask. The backward is in
attention_bwd.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import LOG2_E, check_device, dot_precision, interpreting
from .attention_bwd import attention_backward


@dataclass(frozen=True)
class Tile:
    """One kernel's tile: block_m queries x block_n keys, launched with num_warps warps."""

    block_m: int
    block_n: int
    num_warps: int


@dataclass(frozen=True)
class AttentionBlocks:
    """Tiles of the three attention kernels, fixed per (s, d, dtype) so every rank compiles the
    same kernels. fwd and dq: block_m % block_n == 0 (a query tile covers whole key tiles);
    dkdv: block_n % block_m == 0. The mask-free loops rely on both.
    """

    fwd: Tile
    dkdv: Tile
    dq: Tile
    num_stages: int


def attention_blocks(seq_len: int, head_dim: int, dtype: torch.dtype) -> AttentionBlocks:
    """The tiles for sequence length seq_len, head dim head_dim and input dtype.

    Under the interpreter the tiles are small (16 and 32) so that tiny CPU tests cross several
    tiles and exercise every loop. On CUDA the tiles were chosen so that ptxas reports no
    register spills on sm_90 for bf16 at d = 64 and 128 (fp32 runs exact-fp32 dots without
    tensor cores, on 32 x 32 tiles); they shrink when the sequence is short.
    """
    if interpreting():
        return AttentionBlocks(Tile(32, 16, 4), Tile(16, 32, 4), Tile(32, 16, 4), num_stages=1)
    cap = max(16, triton.next_power_of_2(seq_len))

    def tile(block_m: int, block_n: int, num_warps: int) -> Tile:
        return Tile(min(block_m, cap), min(block_n, cap), num_warps)

    if dtype == torch.float32:
        return AttentionBlocks(tile(32, 32, 8), tile(32, 32, 8), tile(32, 32, 8), num_stages=2)
    wide = head_dim >= 128
    return AttentionBlocks(
        fwd=tile(128, 64, 8 if wide else 4),
        dkdv=tile(32, 64 if wide else 128, 8),
        dq=tile(128, 32, 8 if wide else 4),
        num_stages=2,
    )


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, offs_m, offs_n, offs_d, lo, hi, seq_len, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
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
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [M, N], log2 units
        if MASKED:
            valid = (cols < seq_len)[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            scores = tl.where(valid, scores, float("-inf"))
        # Key 0 is in the first block every row sees, so m_new is finite from the first step.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, seq_len, n_head, group, qk_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    # Causal: the last query blocks have the most keys; launch them first for a balanced tail.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    kv_bh = (bh // n_head) * (n_head // group) + (bh % n_head) // group
    q_base = bh.to(tl.int64) * seq_len * HEAD_DIM
    kv_base = kv_bh.to(tl.int64) * seq_len * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < seq_len
    q_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_base + q_offs, mask=row_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_n = (seq_len // BLOCK_N) * BLOCK_N  # key blocks below full_n have no tail
    if CAUSAL:
        free_hi = tl.minimum(start_m, full_n)
        hi = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        free_hi = full_n
        hi = seq_len
    Kh, Vh = K + kv_base, V + kv_base
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, Kh, Vh, offs_m, offs_n, offs_d, 0, free_hi, seq_len, qk_scale,
        False, CAUSAL, HEAD_DIM, BLOCK_N, PREC,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, Kh, Vh, offs_m, offs_n, offs_d, free_hi, hi, seq_len, qk_scale,
        True, CAUSAL, HEAD_DIM, BLOCK_N, PREC,
    )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(O + q_base + q_offs, out.to(O.dtype.element_ty), mask=row_mask[:, None])
    tl.store(LSE + bh.to(tl.int64) * seq_len + offs_m, m_i + tl.log2(l_i), mask=row_mask)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            "attention: q must be [b, n_head, s, d] and k, v one shape [b, n_kv_head, s, d]; got "
            f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    b, n_head, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, seq_len, head_dim):
        raise ValueError(
            f"attention: k and v {list(k.shape)} must match q {list(q.shape)} in batch, "
            "sequence and head dim"
        )
    if n_head % k.shape[1] != 0:
        raise ValueError(f"attention: n_kv_head {k.shape[1]} must divide n_head {n_head}")
    if head_dim not in (16, 32, 64, 128):
        raise ValueError(f"attention: head dim must be a power of two in 16..128, got {head_dim}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")


def _forward(q, k, v, causal: bool, out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, n_head, s, d] in out_dtype (default q's), base-2 lse [b, n_head, s] fp32) of
    contiguous q, k, v."""
    b, n_head, seq_len, head_dim = q.shape
    blocks = attention_blocks(seq_len, head_dim, q.dtype)
    out = torch.empty_like(q, dtype=out_dtype or q.dtype)
    lse = torch.empty(b, n_head, seq_len, device=q.device, dtype=torch.float32)
    if out.numel() > 0:
        grid = (triton.cdiv(seq_len, blocks.fwd.block_m), b * n_head)
        _attn_fwd_kernel[grid](
            q, k, v, out, lse, seq_len, n_head, n_head // k.shape[1],
            LOG2_E / math.sqrt(head_dim),
            CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_M=blocks.fwd.block_m,
            BLOCK_N=blocks.fwd.block_n, PREC=dot_precision(q.dtype),
            num_warps=blocks.fwd.num_warps, num_stages=blocks.num_stages,
        )  # fmt: skip
    return out, lse


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool):
        check_device(q, k, v)
        _check_shapes(q, k, v)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blocks = attention_blocks(q.shape[2], q.shape[3], q.dtype)
        dq, dk, dv = attention_backward(q, k, v, out, lse, dout, ctx.causal, blocks)
        return dq, dk, dv, None


def attention_block_forward(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of ring attention, no autograd: (out fp32 (fp64 for fp64 inputs), to be merged
    with other blocks; lse [b, n_head, s] fp32 in natural log), shapes as in `attention`."""
    check_device(q, k, v)
    _check_shapes(q, k, v)
    out_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse2 = _forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, out_dtype)
    return out, lse2 * (1.0 / LOG2_E)


def attention_block_backward(q, k, v, out, lse, dout, causal: bool):
    """The flash backward of one block from a given output `out` and natural-log `lse` (a ring's
    final ones, so rowsum(dout * out) is the global one): dq, dk, dv in the inputs' dtype."""
    check_device(q, k, v, out, dout)
    _check_shapes(q, k, v)
    blocks = attention_blocks(q.shape[2], q.shape[3], q.dtype)
    lse2 = (lse.float() * LOG2_E).contiguous()
    return attention_backward(
        q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse2, dout, causal,
        blocks,
    )  # fmt: skip


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), causal mask optional) v -> [b, n_head, s, d] in q's dtype.

    q [b, n_head, s, d], k and v [b, n_kv_head, s, d] with n_kv_head dividing n_head
    (grouped-query: each kv head serves n_head / n_kv_head consecutive query heads).
    Raises ValueError for a head dim that is not 16, 32, 64 or 128.
    """
    return _AttentionFunction.apply(q, k, v, bool(causal))
