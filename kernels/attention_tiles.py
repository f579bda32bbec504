"""Attention tiles shared by the forward (attention.py) and the backward (attention_bwd.py).

Shapes: q [b, n_head, s, d]; k [b, n_kv, s, d]; v [b, n_kv, s, dv], the value head dim dv
equal to the query-key head dim d or not (DeepSeek's latent attention: d 192, dv 128). Holds
the tile of each of the three attention kernels (forward, dK/dV, dQ), the function that picks
them from (s, d, dv, dtype, GPU arch) for the launchers and the compile check
(compile_check.py) alike, the per-block ranges of document masks, the input checks every entry
point runs, and the tile loads the kernels share. Neither kernel module is imported here.

Head dims: tl.arange spans powers of two, so the kernels hold the query-key dim d as a power
of two (16..128) plus, where d is no power of two, a smaller power-of-two rest of at least 16
(a tensor-core dot's least depth): 192 = 128 + 64, 48 = 32 + 16 (split_qk_dim). The scores are
the dot over the first part accumulated with the dot over the rest, and dQ and dK keep one
accumulator per part, so nothing is padded: no register or multiply is spent on zeros. The
value head dim dv is a power of two, 16..128.

Document masks: segments [b, s] int32, each position's document index, non-decreasing along
the sequence, of the queries and of the keys (the same tensor, or in a ring-attention block
the local and the remote shard's). A query sees only keys of its own segment, so a block of
rows (queries, or keys in the dK/dV kernel) needs only the columns whose segment lies between
its first and its last row's: segment_bounds finds that range for every block with one
binary search per block, and the kernels skip the blocks outside it.

Sliding window (WINDOW, window W and offset o, the first query's position less the first
key's: 0 for a sequence attending to itself, a ring block's distance between its query and key
chunks): query i sees key j only when (i + o) - j < W. A block of rows needs only the columns
within reach of its rows' windows, found from the positions alone (no tensor): the kernels
skip the blocks wholly outside every window, mask the blocks the window's edge crosses, and
run the blocks wholly inside without a mask. window_args turns WINDOW off where the window
leaves out no pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import LOG2_E, interpreting

HEAD_DIMS = (16, 32, 64, 128)  # the value head dims, and the query-key dims' first part


def split_qk_dim(qk_dim: int) -> tuple[int, int] | None:
    """(first, rest) with first + rest = qk_dim: first the largest of HEAD_DIMS not above
    qk_dim, rest 0 or a power of two from 16 below first; None when qk_dim is no such sum."""
    first = max((d for d in HEAD_DIMS if d <= qk_dim), default=0)
    rest = qk_dim - first
    if first == 0 or not (rest == 0 or (16 <= rest < first and rest & (rest - 1) == 0)):
        return None
    return first, rest


def qk_dims() -> tuple[int, ...]:
    """Every query-key head dim the kernels take (split_qk_dim's), ascending."""
    return tuple(d for d in range(16, 2 * max(HEAD_DIMS)) if split_qk_dim(d) is not None)


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


def attention_blocks(
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    arch: int,
    v_dim: int | None = None,
    softcap: bool = False,
) -> AttentionBlocks:
    """The tiles for sequence length seq_len, query-key head dim head_dim, value head dim v_dim
    (None: head_dim), input dtype and GPU arch (the compute capability as one number, 80 or 90:
    _utils.device_arch), with soft-capped scores or not.

    Under the interpreter the tiles are small (16 and 32) so that tiny CPU tests cross several
    tiles and exercise every loop. On CUDA they were chosen with scripts/kernel_report.py so
    that ptxas reports no register spills for bf16 on sm_80 and sm_90 at every shipped config
    (and at d = 128, and at DeepSeek-V3's d = 192 with dv = 128), with shared memory well
    under both limits; they shrink when the sequence
    is short (gpu_attention_blocks). fp32 runs exact-fp32 dots without tensor cores, on small
    tiles.
    """
    if interpreting():
        return AttentionBlocks(Tile(32, 16, 4), Tile(16, 32, 4), Tile(32, 16, 4), num_stages=1)
    return gpu_attention_blocks(seq_len, head_dim, dtype, arch, v_dim, softcap)


def gpu_attention_blocks(
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    arch: int,
    v_dim: int | None = None,
    softcap: bool = False,
) -> AttentionBlocks:
    """The tiles a GPU of arch `arch` launches with (attention_blocks off the interpreter),
    wherever this runs: what scripts/bench_packed_attention.py counts block pairs with."""
    cap = max(16, triton.next_power_of_2(seq_len))

    def tile(block_m: int, block_n: int, num_warps: int) -> Tile:
        return Tile(min(block_m, cap), min(block_n, cap), num_warps)

    width = max(head_dim, v_dim or head_dim)
    if dtype == torch.float32:
        # Exact-fp32 dots run on FMA units; sm_90 lowers a 32 x 32 forward tile with 8 warps
        # into 255 registers and spills at d = 128, 16 x 16 with 4 warps stays under 80 on both.
        # Past d = 128 (192 / 128) the backward's 32 x 32 tiles spill 200-350 bytes on sm_90;
        # 16-wide query (dK/dV) and key (dQ) blocks stay under 135 registers.
        if width > 128:
            return AttentionBlocks(tile(16, 16, 4), tile(16, 32, 8), tile(32, 16, 8), 2)
        return AttentionBlocks(tile(16, 16, 4), tile(32, 32, 8), tile(32, 32, 8), num_stages=2)
    # A value head dim unlike the query-key one (DeepSeek's latent attention) takes dK/dV key
    # blocks of 32: at 32 x 64 (d = 128) or 32 x 128 (d <= 64) its mixed accumulators spill,
    # 192 / 128 under four query heads a kv head by 80 bytes on sm_90 (32 x 32: 231 registers).
    mixed = v_dim is not None and v_dim != head_dim
    # A soft-cap keeps each score's tanh live into dS: at d = 128 on sm_80 the 32 x 64 dK/dV
    # tile then spills 8 bytes under document masks and a window (255 registers).
    narrow = mixed or (softcap and width >= 128 and arch < 90)
    if width > 128:
        # A query-key dim past 128 (192 with values of 128) holds up to 320 columns of q, k,
        # dq, dk, v, dv per row where d = 128 holds 256. sm_90's wgmma reads the second operand
        # from shared memory and keeps the d = 128 forward and dQ tiles (at 192 / 128 under
        # document masks and a window: 248 and 237 registers, no spills); sm_80's mma.sync
        # holds both operands in registers and spills with them, so it halves the forward's
        # query block and dQ takes 32 x 32.
        if arch >= 90:
            return AttentionBlocks(tile(128, 64, 8), tile(32, 32, 8), tile(128, 32, 8), 2)
        return AttentionBlocks(tile(64, 64, 8), tile(32, 32, 8), tile(32, 32, 8), num_stages=2)
    # Query-key and value dims of at most 128 take the tiles of the power of two that holds
    # both: a kernel then holds no more columns than at equal head dims of that size.
    wide = triton.next_power_of_2(width) >= 128
    # The forward at d = 128 is the one tile that cannot serve both archs: sm_80's mma.sync
    # takes both operands in registers, so a 128 x 64 score tile next to the 128 x 128 fp32
    # accumulator needs 255 registers and spills with 8 warps, where sm_90's wgmma reads k and
    # v from shared memory (188 registers, no spills). sm_80 takes key blocks of 32 instead.
    fwd_n = 32 if wide and arch < 90 else 64
    return AttentionBlocks(
        fwd=tile(128, fwd_n, 8),
        dkdv=tile(32, 32 if narrow else 64 if wide else 128, 8),
        dq=tile(128, 32, 8),
        num_stages=2,
    )


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ValueError unless q [b, n_head, s, d], k [b, n_kv, s, d] and v [b, n_kv, s, dv]
    with n_kv dividing n_head, d one of qk_dims(), dv one of HEAD_DIMS, and one dtype for all
    three."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "attention: q must be [b, n_head, s, d], k [b, n_kv_head, s, d] and v "
            f"[b, n_kv_head, s, dv]; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    b, n_head, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, seq_len, head_dim):
        raise ValueError(
            f"attention: k {list(k.shape)} must match q {list(q.shape)} in batch, sequence and "
            "head dim"
        )
    if n_head % k.shape[1] != 0:
        raise ValueError(f"attention: n_kv_head {k.shape[1]} must divide n_head {n_head}")
    if split_qk_dim(head_dim) is None or v.shape[3] not in HEAD_DIMS:
        raise ValueError(
            f"attention: head dims (query-key {head_dim}, value {v.shape[3]}) not supported; "
            f"valid query-key head dims: {', '.join(map(str, qk_dims()))}; value head dims: "
            f"{', '.join(map(str, HEAD_DIMS))}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")


def segment_bounds(rows: torch.Tensor, cols: torch.Tensor, block: int) -> torch.Tensor:
    """int32 [b, cdiv(s, block), 2]: for each block of `block` rows of the segments rows
    [b, s], the range [lo, hi) of the positions of cols [b, s] whose segment is between the
    block's first and last row's (both sorted: a binary search each)."""
    seq_len = rows.shape[1]
    first = torch.arange(0, seq_len, block, device=rows.device)
    last = (first + block).clamp(max=seq_len) - 1
    lo = torch.searchsorted(cols, rows[:, first].contiguous(), out_int32=True)
    hi = torch.searchsorted(cols, rows[:, last].contiguous(), out_int32=True, side="right")
    return torch.stack([lo, hi], dim=-1).contiguous()


def window_args(
    window: int | None, offset: int, seq_len: int
) -> tuple[bool, int | None, int | None]:
    """The kernels' (WINDOW, window, offset) for a sliding window (None: no window) over
    seq_len queries and keys whose positions differ by offset: WINDOW false, and window and
    offset None (absent: the kernel compiles as without a window), when the window leaves out
    no pair (the farthest key, seq_len - 1 + offset behind the last query, is within it).
    Raises ValueError for a window below 1."""
    if window is not None and window < 1:
        raise ValueError(f"attention: the sliding window must be >= 1, got {window}")
    if window is None or window > seq_len - 1 + offset:
        return False, None, None
    return True, window, offset


def score_args(head_dim: int, scale: float | None, softcap: float | None):
    """The kernels' (SOFTCAP, sm_scale, qk_scale, cap_in) for softmax scale `scale` (None:
    1 / sqrt(head_dim)) and logit soft-cap `softcap` (None: none): the kernels take the scores
    s = q.k sm_scale to base-2 logits as s qk_scale, or, capped, as (2 sigmoid(q.k cap_in) - 1)
    qk_scale = c tanh(s / c) log2(e) (tanh(x) = 2 sigmoid(2 x) - 1, so cap_in = 2 sm_scale / c);
    cap_in None without a soft-cap. Raises ValueError for a soft-cap that is not positive."""
    sm_scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if softcap is None:
        return False, sm_scale, sm_scale * LOG2_E, None
    if not softcap > 0:
        raise ValueError(f"attention: the soft-cap must be > 0, got {softcap}")
    return True, sm_scale, softcap * LOG2_E, 2.0 * sm_scale / softcap


def check_segments(q: torch.Tensor, segments: tuple[torch.Tensor, torch.Tensor] | None):
    """The (query, key) segments as contiguous int32 [b, s] on q's device, or None; raises
    ValueError unless each is [b, s] of q."""
    if segments is None:
        return None
    b, _, seq_len, _ = q.shape
    for seg in segments:
        if tuple(seg.shape) != (b, seq_len):
            raise ValueError(
                f"attention: segments must be [b, s] = {[b, seq_len]}, got {list(seg.shape)}"
            )
    return tuple(seg.to(device=q.device, dtype=torch.int32).contiguous() for seg in segments)


@triton.jit
def query_block_keys(
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
    CAUSAL: tl.constexpr,
    DOCS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The key range of one query block (the forward's and dQ's walk): keys [lo, band_hi) need
    the window's mask (empty unless WINDOW), [band_hi, free_hi) no mask, [masked_lo, hi) the
    causal, tail, document and window masks; q_seg, the queries' segments (zeros unless DOCS)
    and seg_base, this sequence's offset into the segment arrays."""
    full_n = (seq_len // BLOCK_N) * BLOCK_N  # key blocks below full_n have no tail
    if CAUSAL:
        free_hi = tl.minimum(start_m, full_n)
        hi = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        free_hi = full_n
        hi = seq_len
    lo, masked_lo = 0, free_hi
    q_seg = tl.zeros([BLOCK_M], dtype=tl.int32)  # one document unless DOCS
    seg_base = (bh // n_head).to(tl.int64) * seq_len  # this sequence's segments
    if DOCS:  # only the key blocks that hold keys of this query block's documents
        q_seg = tl.load(QSEG + seg_base + offs_m, mask=row_ok, other=-2)
        bounds = BOUNDS + ((bh // n_head) * tl.num_programs(0) + block_m) * 2
        lo = (tl.load(bounds) // BLOCK_N) * BLOCK_N
        doc_hi = tl.load(bounds + 1)
        masked_lo = tl.maximum(free_hi, lo)  # where the unmasked walk ends
        free_hi = tl.minimum(free_hi, tl.cdiv(doc_hi, BLOCK_N) * BLOCK_N)
        hi = tl.minimum(hi, doc_hi)
    band_hi = lo
    if WINDOW:  # only the key blocks within reach of this query block's windows
        first = tl.maximum(start_m + offset - window + 1, 0)  # the first key its first row sees
        lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
        inside = tl.maximum(start_m + BLOCK_M + offset - window, 0)  # keys in every row's window
        band_hi = tl.maximum(lo, tl.minimum(tl.cdiv(inside, BLOCK_N) * BLOCK_N, free_hi))
        masked_lo = tl.maximum(masked_lo, band_hi)
    return lo, band_hi, free_hi, masked_lo, hi, q_seg, seg_base


@triton.jit
def load_rows(
    PTR,
    rows,
    row_ok,
    STRIDE: tl.constexpr,
    START: tl.constexpr,
    WIDTH: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The [rows, WIDTH] tile of the columns START.. of a row-major matrix of STRIDE columns;
    MASKED: the rows that are not row_ok read as zeros."""
    offs = rows[:, None] * STRIDE + START + tl.arange(0, WIDTH)[None, :]
    if MASKED:
        tile = tl.load(PTR + offs, mask=row_ok[:, None], other=0.0)
    else:
        tile = tl.load(PTR + offs)
    return tile
