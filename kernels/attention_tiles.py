"""Attention tiles shared by the forward (attention.py) and the backward (attention_bwd.py).

Shapes: q [b, n_head, s, d]; k, v [b, n_kv, s, d]. Holds the tile of each of the three
attention kernels (forward, dK/dV, dQ), the function that picks them from (s, d, dtype), and
the input checks every entry point runs. Neither kernel module is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ._utils import interpreting


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


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises ValueError unless q [b, n_head, s, d], k and v one shape [b, n_kv, s, d] with
    n_kv dividing n_head, d in 16, 32, 64, 128, and one dtype for all three."""
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
