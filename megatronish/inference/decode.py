"""Incremental decoding with a cache of each block's keys and values (generate): one step of
the model over the new tokens, reading and extending the cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatronish.model import GPT


@torch.no_grad()
def decode_step(model: GPT, tokens: torch.Tensor, cache: list, start_pos: int) -> torch.Tensor:
    """tokens [b, s] at positions start_pos..start_pos + s - 1 -> this rank's logits
    [b, s, V / t] for those positions, as model's forward on the whole sequence gives them
    (eval mode, one stage, no sequence parallelism). `cache` is a list, empty at start_pos 0,
    that holds each block's keys and values (Block.forward_cached); it is updated in place."""
    if model.sequence_parallel or model.derived.pp > 1:
        raise RuntimeError("decode_step runs at pp 1 with sequence_parallel false")
    s = tokens.shape[1]
    if start_pos + s > model.cfg.model.max_seq_len:
        raise ValueError(f"positions up to {start_pos + s} > max_seq_len")
    x = model.scaled(model.tok_emb(tokens))  # [b, s, h]
    if model.pos_emb is not None:
        x = x + model.pos_emb(torch.arange(start_pos, start_pos + s, device=tokens.device))
    for index, block in enumerate(model.blocks.values()):
        x, kv = block.forward_cached(x, cache[index] if index < len(cache) else None, start_pos)
        if index < len(cache):
            cache[index] = kv
        else:
            cache.append(kv)
    return model.logits(model.norm_f(x))
