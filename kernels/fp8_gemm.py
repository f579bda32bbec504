"""The scaled fp8 GEMM: out [M, N] = A [M, K] B [N, K]^T of fp8 payloads with float32 scales
per 128-wide K block, accumulated in fp32, written in the high-precision dtype (bf16 or fp32).

A payload stands for payload / scale (megatronish.fp8.scaling). Each K block of 128 is one
fp8 dot (exact products, fp32 sums), multiplied by the product of its two scales' reciprocals
and added to the fp32 accumulator (a few fp32 roundings more than the emulation's division of
each operand: the same sum to fp32 rounding).

The scales of A are per row and K block, sa [M, ceil(K / 128)]; those of B per row of B and K
block, sb [N, ceil(K / 128)], or per 128 x 128 block (B_BLOCK), sb [ceil(N / 128),
ceil(K / 128)]. Row and tensor scales are the same with a zero stride along K
(and along the rows). The three GEMMs of a linear layer under the blockwise recipe:

    forward      Y  = X W^T      A = X tiles [T, in]        B = W blocks [out, in]
    grad input   dX = dY W       A = dY tiles [T, out]      B = W^T blocks [in, out]
    grad weight  dW = dY^T X     A = dY^T tiles [out, T]    B = X^T tiles [in, T]

(the weight-gradient operands have their 128-wide tiles along the tokens, K there). Operands
take any strides, so W^T is the forward's weight payload read transposed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device, interpreting

BLOCK_K = 128  # one scale per K step: the width of the scaling groups


def gemm_tiles() -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 64 x 128 tiles in 8 warps and 4 stages of
    24 KiB on sm_89 and sm_90 (128 x 128 tiles hold two fp32 tiles, the accumulator and a K
    block's product, in 8 warps: 255 registers and spills, kernel_report.py); 64 x 64 under
    the interpreter."""
    if interpreting():
        return 64, 64, 4, 1
    return 64, 128, 8, 4


@triton.jit
def _fp8_gemm_kernel(
    A,
    B,
    SA,
    SB,
    C,
    M,
    N,
    K,
    sam,
    sak,
    sbn,
    sbk,
    ssam,
    ssak,
    ssbn,
    ssbk,
    scm,
    scn,
    B_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    b_rows = cols64 // BLOCK_K if B_BLOCK else cols64
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        ks64 = ks.to(tl.int64)
        a = tl.load(
            A + rows64[:, None] * sam + ks64[None, :] * sak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(  # [BLOCK_K, BLOCK_N]: B transposed
            B + ks64[:, None] * sbk + cols64[None, :] * sbn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        inv_a = 1.0 / tl.load(SA + rows64 * ssam + kb * ssak, mask=row_ok, other=1.0)
        inv_b = 1.0 / tl.load(SB + b_rows * ssbn + kb * ssbk, mask=col_ok, other=1.0)
        part = tl.dot(a, b, out_dtype=tl.float32)
        acc += part * (inv_a[:, None] * inv_b[None, :])
    out = C + rows64[:, None] * scm + cols64[None, :] * scn
    tl.store(out, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _scale_strides(scale: torch.Tensor, rows: int) -> tuple[int, int]:
    """(row stride, K-block stride) of a scale tensor: [rows or blocks, K blocks], [rows, 1]
    (a row scale, the same in every K block) or one value (a tensor scale)."""
    if scale.numel() == 1:
        return 0, 0
    if scale.dim() != 2:
        raise ValueError(f"fp8_gemm: scales of shape {tuple(scale.shape)} for {rows} rows")
    return scale.stride(0), 0 if scale.shape[1] == 1 else scale.stride(1)


def fp8_gemm_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    out: torch.Tensor,
    b_block: bool,
) -> Launch:
    """The launch of out [M, N] = (a / sa) [M, K] (b / sb) [N, K]^T (see the module)."""
    m, k = a.shape
    n = b.shape[0]
    block_m, block_n, warps, stages = gemm_tiles()
    args = (
        a,
        b,
        sa,
        sb,
        out,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        *_scale_strides(sa, m),
        *_scale_strides(sb, n),
        out.stride(0),
        out.stride(1),
    )
    consts = dict(B_BLOCK=b_block, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    return Launch(_fp8_gemm_kernel, grid, args, consts, num_warps=warps, num_stages=stages)


def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    out_dtype: torch.dtype,
    b_block: bool = False,
) -> torch.Tensor:
    """(a / sa) (b / sb)^T in out_dtype for fp8 payloads a [M, K], b [N, K] (any strides) and
    float32 scales sa [M, ceil(K / 128)] and sb [N, ceil(K / 128)] (b_block: [ceil(N / 128),
    ceil(K / 128)]), or [rows, 1] per row, or one per tensor."""
    check_device(a, b, sa, sb)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm: a {tuple(a.shape)} and b {tuple(b.shape)}: [M, K], [N, K]")
    out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    sa, sb = sa.to(torch.float32), sb.to(torch.float32)
    fp8_gemm_launch(a, b, sa, sb, out, b_block).run()
    return out
