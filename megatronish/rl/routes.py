"""Routing replay's routes on the policy's side (moe.replay): each sequence's recorded experts,
checked, then laid out on a packed row's tokens and sharded as the row is.

A sequence's routes are int64 [n_moe, n_i, k] or [n_moe, n_i - 1, k] (a generation records
the prompt and every token it fed back, so its last sampled token has none; that position's
logits predict nothing and it routes freely), n_moe the model's MoE layers in order.
"""

from __future__ import annotations

import torch

from megatronish.config import Config, moe_layers
from megatronish.errors import UserError
from megatronish.moe.replay import RoutedDocuments
from megatronish.rl.packing import Row, shard_row


def check_routes(routes: list[torch.Tensor], seqs: list[list[int]], cfg: Config) -> None:
    """UserError naming the first entry of routes that does not fit its sequence or the model."""
    n_moe, top_k, experts = len(moe_layers(cfg)), cfg.model.moe.top_k, cfg.model.moe.num_experts
    if n_moe == 0:
        raise UserError("routes: the model has no MoE layers; pass routes=None")
    if len(routes) != len(seqs):
        raise UserError(f"routes: {len(routes)} entries for {len(seqs)} sequences")
    for index, (route, seq) in enumerate(zip(routes, seqs, strict=True)):
        shape = tuple(route.shape)
        if route.dim() != 3 or shape[0] != n_moe or shape[2] != top_k:
            raise UserError(
                f"routes[{index}]: shape {list(shape)}; must be [{n_moe} MoE layers, tokens, "
                f"{top_k} experts]"
            )
        if shape[1] not in (len(seq), len(seq) - 1):
            raise UserError(f"routes[{index}]: {shape[1]} tokens for a {len(seq)}-token sequence")
        if route.numel() and not (0 <= int(route.min()) and int(route.max()) < experts):
            raise UserError(f"routes[{index}]: an expert outside 0 .. {experts - 1}")


def routed(
    documents, row: Row, routes: list[torch.Tensor], cp: int, cp_rank: int
) -> RoutedDocuments:
    """This cp rank's shard of a row's documents with the routes of its members (int64
    [1, L / cp, n_moe, k]; -1 at the filler and at positions a sequence has none for)."""
    n_moe, _, top_k = routes[row.members[0]].shape
    whole = torch.full((row.length, n_moe, top_k), -1, dtype=torch.int64)
    for index, offset in zip(row.members, row.offsets, strict=True):
        route = routes[index].to(torch.int64)
        whole[offset : offset + route.shape[1]] = route.transpose(0, 1)
    shard = shard_row(whole[None], cp, cp_rank).to(documents.segments.device)
    return RoutedDocuments(documents.segments, documents.positions, documents.shards, shard)
