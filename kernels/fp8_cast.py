"""FP8 casts with their scales fused: the amax of each scaling group, its scale and the
saturated, rounded fp8 payload, with the arithmetic of megatronish.fp8.scaling (bit for bit):

    scale = fp8_max / max(amax, 1e-12)     in float64, rounded to float32
            (pow2: exp2(floor(log2(scale))), log2 rounded to float32 before the floor)
    payload = fp8(clamp(float32(x) * scale, -fp8_max, fp8_max))   round to nearest, ties to even

The operand is read as a matrix x [rows, K] with any strides (a transposed view costs no copy)
and its payload written contiguous [rows, K]; the scales (float32) have the layouts of
megatronish.fp8.granularity: tensor [1], row [rows, 1], tile [rows, ceil(K / 128)] (1 x 128
along K), block [ceil(rows / 128), ceil(K / 128)].

Tensorwise takes two passes (`_amax_kernel`: an atomic max over tiles, exact in any order;
then the cast, whose first program writes the scale); row, tile and block take one (each
program finds its groups' amaxes and casts them). Where an amax must be reduced over ranks
first, or a scale is already known, the cast takes it instead (SOURCE "amax" or "scale").

The rounding is done in float32 arithmetic before the conversion (`_round_fp8`), so the
conversion itself only meets fp8 values: Triton's interpreter converts float32 to fp8 with
its own rounding (not ties to even), a GPU with round to nearest even; both store an exact
fp8 value unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device, interpreting

GROUP = 128
"""The width of a tile and the side of a block."""
# (mantissa bits, smallest normal exponent) of the fp8 formats.
FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}

TILE_ROWS = 32  # rows of a tile-cast program (each row one 1 x 128 tile)
AMAX_TILE = (32, 256)  # the tensorwise amax pass's tile
TENSOR_TILE = (32, 128)  # the tensorwise cast's (its rounding needs registers)


def row_tile() -> tuple[int, int]:
    """(rows, K elements) a row-cast program reads per step: 8 x 512 on a GPU, 64 x 256 under
    the interpreter (fewer programs)."""
    return (64, 256) if interpreting() else (8, 512)


@triton.jit
def _round_fp8(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """y (float32, within the fp8 range) rounded to the nearest fp8 value (ties to even), as
    float32: |y| is a multiple of its fp8 quantum q = 2^(max(e, EMIN) - MANT); |y| / q is
    exact, and so are its floor, the remainder and the product back."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN) - MANT
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    quantum = ((127 + exponent) << 23).to(tl.float32, bitcast=True)
    z = tl.abs(y) * inverse
    whole = tl.floor(z)
    rest = z - whole
    odd = (whole.to(tl.int32) & 1) == 1
    up = (rest > 0.5) | ((rest == 0.5) & odd)
    rounded = (whole + up.to(tl.float32)) * quantum
    return tl.where(bits < 0, -rounded, rounded)  # the sign bit: -0.0 stays -0.0


@triton.jit
def _scale(amax, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """The float32 scale of a float32 amax (scaling.amax_to_scale)."""
    eps = tl.full(amax.shape, 1e-12, tl.float64)  # scaling.AMAX_EPS
    scale = (FP8_MAX / tl.maximum(amax.to(tl.float64), eps)).to(tl.float32)
    if POW2:
        power = tl.floor(tl.log2(scale.to(tl.float64)).to(tl.float32))
        scale = tl.exp2(power.to(tl.float64)).to(tl.float32)
    return scale


@triton.jit
def _to_fp8(x, scale, Q_TY, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX)
    return _round_fp8(y, MANT, EMIN).to(Q_TY, fp_downcast_rounding="rtne")


@triton.jit
def _amax_kernel(X, AMAX, rows, K, sxr, sxk, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (r < rows)[:, None] & (k < K)[None, :]
    offsets = r.to(tl.int64)[:, None] * sxr + k.to(tl.int64)[None, :] * sxk
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(AMAX, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


@triton.jit
def _tile_cast_kernel(
    X,
    Q,
    AMAX,
    SCALE,
    rows,
    K,
    sxr,
    sxk,
    scale_cols,
    GRANULARITY: tl.constexpr,
    SOURCE: tl.constexpr,
    POW2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Tensor (BLOCK_K any), tile (BLOCK_K = 128: one tile per row) or block (BLOCK_R =
    BLOCK_K = 128) granularity over one [BLOCK_R, BLOCK_K] tile of x."""
    pid_r, pid_k = tl.program_id(0), tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = r < rows
    mask = r_ok[:, None] & (k < K)[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(X + r64[:, None] * sxr + k.to(tl.int64)[None, :] * sxk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if GRANULARITY == "tensor":
        if SOURCE == "scale":
            scale = tl.load(SCALE)
        else:
            scale = _scale(tl.load(AMAX), FP8_MAX, POW2)
            tl.store(SCALE, scale, mask=(pid_r == 0) & (pid_k == 0))
        q = _to_fp8(x, scale, Q.dtype.element_ty, FP8_MAX, MANT, EMIN)
    elif GRANULARITY == "tile":
        where = r64 * scale_cols + pid_k
        if SOURCE == "scale":
            scale = tl.load(SCALE + where, mask=r_ok, other=1.0)
        else:
            if SOURCE == "amax":
                amax = tl.load(AMAX + where, mask=r_ok, other=0.0)
            else:
                amax = tl.max(tl.abs(x), axis=1)
            scale = _scale(amax, FP8_MAX, POW2)
            tl.store(SCALE + where, scale, mask=r_ok)
        q = _to_fp8(x, scale[:, None], Q.dtype.element_ty, FP8_MAX, MANT, EMIN)
    else:
        where = pid_r * scale_cols + pid_k
        if SOURCE == "scale":
            scale = tl.load(SCALE + where)
        else:
            if SOURCE == "amax":
                amax = tl.load(AMAX + where)
            else:
                amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            scale = _scale(amax, FP8_MAX, POW2)
            tl.store(SCALE + where, scale)
        q = _to_fp8(x, scale, Q.dtype.element_ty, FP8_MAX, MANT, EMIN)
    tl.store(Q + r64[:, None] * K + k[None, :], q, mask=mask)


@triton.jit
def _row_cast_kernel(
    X,
    Q,
    AMAX,
    SCALE,
    rows,
    K,
    sxr,
    sxk,
    SOURCE: tl.constexpr,
    POW2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_R whole rows: their amaxes (one sweep along K), scales, then the cast (a second
    sweep, which finds the rows in cache)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    r64 = r.to(tl.int64)
    if SOURCE == "scale":
        scale = tl.load(SCALE + r64, mask=r_ok, other=1.0)
    else:
        if SOURCE == "amax":
            amax = tl.load(AMAX + r64, mask=r_ok, other=0.0)
        else:
            amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                mask = r_ok[:, None] & (k < K)[None, :]
                offsets = r64[:, None] * sxr + k.to(tl.int64)[None, :] * sxk
                x = tl.load(X + offsets, mask=mask, other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = _scale(amax, FP8_MAX, POW2)
        tl.store(SCALE + r64, scale, mask=r_ok)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = r_ok[:, None] & (k < K)[None, :]
        x = tl.load(X + r64[:, None] * sxr + k.to(tl.int64)[None, :] * sxk, mask=mask)
        q = _to_fp8(x.to(tl.float32), scale[:, None], Q.dtype.element_ty, FP8_MAX, MANT, EMIN)
        tl.store(Q + r64[:, None] * K + k[None, :], q, mask=mask)


def scale_shape(granularity: str, rows: int, k: int) -> tuple[int, ...]:
    """The layout of the scales of x [rows, K] (megatronish.fp8.granularity)."""
    blocks = triton.cdiv(k, GROUP)
    return {
        "tensor": (),
        "row": (rows, 1),
        "tile": (rows, blocks),
        "block": (triton.cdiv(rows, GROUP), blocks),
    }[granularity]


def amax_launch(x: torch.Tensor, amax: torch.Tensor) -> Launch:
    """The tensorwise first pass: max |x| into amax (float32 [1], zeroed)."""
    rows, k = x.shape
    block_r, block_k = AMAX_TILE
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    args = (x, amax, rows, k, x.stride(0), x.stride(1))
    return Launch(_amax_kernel, grid, args, dict(BLOCK_R=block_r, BLOCK_K=block_k), num_warps=4)


def cast_launch(
    x: torch.Tensor,
    q: torch.Tensor,
    amax: torch.Tensor | None,
    scale: torch.Tensor,
    granularity: str,
    source: str,
    power_of_2: bool,
) -> Launch:
    """The cast of x [rows, K] into q (contiguous fp8 [rows, K]) at granularity, its scales
    into `scale` (float32, scale_shape): computed here from the amaxes (source "compute"; for
    tensor, from the first pass's amax: "amax"), from given amaxes ("amax") or read ("scale")."""
    rows, k = x.shape
    mant, emin = FORMATS[q.dtype]
    consts = dict(
        SOURCE=source, POW2=power_of_2, FP8_MAX=torch.finfo(q.dtype).max, MANT=mant, EMIN=emin
    )
    amax = scale if amax is None else amax  # an unread pointer where the source is "scale"
    args = (x, q, amax, scale, rows, k, x.stride(0), x.stride(1))
    if granularity == "row":
        block_r, block_k = row_tile()
        grid = (triton.cdiv(rows, block_r),)
        consts.update(BLOCK_R=block_r, BLOCK_K=block_k)
        return Launch(_row_cast_kernel, grid, args, consts, num_warps=4)
    block_r = {"tensor": TENSOR_TILE[0], "tile": TILE_ROWS, "block": GROUP}[granularity]
    block_k = TENSOR_TILE[1] if granularity == "tensor" else GROUP
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    consts.update(GRANULARITY=granularity, BLOCK_R=block_r, BLOCK_K=block_k)
    scale_cols = triton.cdiv(k, GROUP)
    warps = 16 if granularity == "block" else 4
    return Launch(_tile_cast_kernel, grid, (*args, scale_cols), consts, num_warps=warps)


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| of a matrix x (any strides) as float32 [1]: the tensorwise first pass."""
    check_device(x)
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    amax_launch(x, amax).run()
    return amax


def fp8_cast(
    x: torch.Tensor,
    granularity: str,
    dtype: torch.dtype,
    power_of_2: bool = False,
    amax: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] (fp32 or bf16, any strides) as fp8 `dtype` (e4m3fn or e5m2) with its float32
    scales at granularity ("tensor", "row", "tile", "block"): (payload [rows, K] contiguous,
    scales in scale_shape). With `scale` given the cast uses it; with `amax` given (after a
    reduction over ranks, in scale_shape's layout) the scales come from it; otherwise from x
    (tensor: two passes, the others one)."""
    check_device(x, amax, scale)
    if x.dim() != 2 or not x.numel() or dtype not in FORMATS:
        raise ValueError(
            f"fp8_cast: x {tuple(x.shape)} to {dtype}: a non-empty matrix, to e4m3fn or e5m2"
        )
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=dtype, device=x.device)
    if scale is not None:
        out = scale.to(torch.float32).reshape(scale_shape(granularity, rows, k)).contiguous()
        source = "scale"
    else:
        if amax is None and granularity == "tensor":
            amax = fp8_amax(x)
        source = "compute" if amax is None else "amax"
        if amax is not None:
            amax = amax.to(torch.float32).contiguous()
        out = torch.empty(scale_shape(granularity, rows, k), dtype=torch.float32, device=x.device)
    cast_launch(x, q, amax, out, granularity, source, power_of_2).run()
    return q, out
