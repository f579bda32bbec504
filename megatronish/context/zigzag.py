"""The zigzag split of a sequence over the cp ranks (causal load balance).

Legend: s the full sequence, cp the context-parallel degree, c = s / (2 cp) tokens a chunk.
The sequence is cut into 2 cp chunks of c tokens; cp rank r holds chunk r, then chunk
2 cp - 1 - r. Under a causal mask the early chunk of a rank attends to few keys and its late
chunk to many, so every rank does the same attention work. A rank's local sequence [2c] keeps
increasing positions, so causal attention of a rank's own tokens is the plain causal mask.
"""

from __future__ import annotations

import torch


def chunks_of(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices cp rank cp_rank holds, in local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's two chunks of x along dim (length s, divisible by 2 cp), concatenated:
    [.., s, ..] -> [.., s / cp, ..]. cp 1 returns x itself."""
    if cp == 1:
        return x
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2 x cp = {2 * cp}")
    pieces = x.chunk(2 * cp, dim=dim)
    first, second = chunks_of(cp, cp_rank)
    return torch.cat([pieces[first], pieces[second]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every cp rank's shard (in cp rank order): the inverse of
    shard_sequence."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for cp_rank, shard in enumerate(shards):
        first, second = chunks_of(cp, cp_rank)
        pieces[first], pieces[second] = shard.chunk(2, dim=dim)
    return torch.cat(pieces, dim=dim)


def zigzag_positions(local_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions (int64 [local_len]) of this cp rank's local tokens: the true
    position of each token in the full sequence of local_len * cp tokens."""
    c = local_len // 2
    first, second = chunks_of(cp, cp_rank)
    return torch.cat(
        [
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ]
    )


def split_batch(
    batch: torch.Tensor, cp: int, cp_rank: int, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of this cp rank from a loader batch [..., s + 1]: the targets are
    shifted by one over the full sequence first (and set to -100, ignored by the loss, where
    loss_mask [..., s] is false), then both are sharded: two [..., s / cp]."""
    inputs, targets = batch[..., :-1], batch[..., 1:]
    if loss_mask is not None:
        targets = targets.masked_fill(~loss_mask.to(targets.device), -100)
    dim = batch.dim() - 1
    return shard_sequence(inputs, cp, cp_rank, dim), shard_sequence(targets, cp, cp_rank, dim)
