"""Multi-token prediction (model.mtp_depth; DeepSeek-V3, section 2.2).

Module k (1..D, D = mtp_depth) at position i combines the previous depth's output h^{k-1}_i
with the embedding of the token k positions ahead, t_{i+k}:
eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)]) (2h -> h, the order of the published
checkpoints), then one transformer block (the model's own Block, at index n_layer + k - 1:
dense or MoE as config.derive.moe_layers says) and its own final norm: h^k. h^0 is the main
model's output after its final norm (what its output layer takes), and h^k is both the input of
the main model's output layer for depth k and depth k + 1's h^k, as transformers' MtpModel and
the published checkpoints' inference engines chain them. Its target is t_{i+k+1}, the main
targets shifted by k: positions without one (the last k of a sequence) and positions whose
shifted main target does not count (a loss mask, data.eod_mask_loss) are -100.
The loss the model trains on is the main loss plus mtp_loss_coef times the mean over the depths
of their cross-entropies; the main loss alone is what `loss` and every evaluation report.

The tokens and targets ahead are shifted on the whole sequences, before the zigzag split over
cp ranks (`future_tokens_of`, then sharded like the inputs), so the token k ahead of a rank's
last token of a chunk is the right one. Causal attention keeps the tokens past the end
(padding, with no target) from reaching any position that has one.

Shapes: b batch, s sequence (s / cp on a cp rank; s / t of the hidden states under sequence
parallelism), h d_model, D depth.
"""

from __future__ import annotations

import torch
from torch import nn

from megatronish.config import ModelConfig
from megatronish.context import Documents, shard_sequence
from megatronish.distributed.layout import RNGTracker
from megatronish.layers import mappings
from megatronish.layers.cross_entropy import IGNORE_INDEX
from megatronish.layers.linear import mark_parallel
from megatronish.layers.roles import set_role
from megatronish.model.block import Block
from megatronish.model.norm import hidden_norm
from megatronish.model.plan import BlockPlan
from megatronish.model.recompute import checkpoint


def future_tokens_of(inputs: torch.Tensor, targets: torch.Tensor, depth: int) -> torch.Tensor:
    """The tokens and targets ahead of whole sequences inputs and targets [..., s] (targets:
    -100 where they do not count): int64 [..., 2, depth, s], [..., 0, k - 1, i] the input token
    at i + k (0 past the end) and [..., 1, k - 1, i] the target at i + k (-100 past the end)."""
    rows = []
    for source, fill in ((inputs, 0), (targets, IGNORE_INDEX)):
        shifted = [
            torch.cat([source[..., k:], torch.full_like(source[..., :k], fill)], dim=-1)
            for k in range(1, depth + 1)
        ]
        rows.append(torch.stack(shifted, dim=-2))
    return torch.stack(rows, dim=-3)


def shard_future_tokens(future_tokens: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's zigzag shard of future_tokens_of's [..., 2, D, s] ->
    [..., 2, D, s / cp]."""
    return shard_sequence(future_tokens, cp, cp_rank, future_tokens.dim() - 1)


class MTPLayer(nn.Module):
    """Module k of multi-token prediction: enorm, hnorm, eh_proj, block, norm (the published
    names; eh_proj replicated on the tp ranks, its gradient summed over tp under sequence
    parallelism as the norms'). plan: its block's (index n_layer + k - 1)."""

    def __init__(self, model: ModelConfig, plan: BlockPlan):
        super().__init__()
        h = model.d_model
        self.enorm, self.hnorm = hidden_norm(model, plan), hidden_norm(model, plan)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        mark_parallel(self.eh_proj.weight, None, (h, 2 * h))
        set_role(self.eh_proj.weight, sequence_parallel_grad=plan.sequence_parallel)
        self.block = Block(model, plan)
        self.norm = hidden_norm(model, plan)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        documents: Documents | None,
        tracker: RNGTracker | None,
    ) -> torch.Tensor:
        """h^{k-1} [b, s, h] and the embeddings ahead [b, s, h] -> h^k [b, s, h] (after the
        module's norm); tracker: recompute the block in backward (full activation
        checkpointing)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if tracker is not None:
            x = checkpoint(self.block, tracker, x, documents)
        else:
            x = self.block(x, documents)
        return self.norm(x)


class MTP(nn.Module):
    """The mtp_depth modules of the last pipeline stage (ZeRO-3 gathers their parameters with
    the final norm's: GPT.forward_param_uses)."""

    def __init__(self, model: ModelConfig, plans: list[BlockPlan]):
        """plans: the plans of the modules' blocks, depth 1 first (one per model.mtp_depth)."""
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(model, plan) for plan in plans)
        self.sequence_parallel = plans[0].sequence_parallel
        self.tp_group = plans[0].ps.tp_group

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        documents: Documents | None,
        tracker: RNGTracker | None,
    ) -> tuple[torch.Tensor, ...]:
        """The main model's output after its final norm [b, s, h] and the embeddings ahead
        [b, D, s, h] (whole sequences on every tp rank) -> each depth's h^k [b, s, h] (normed),
        for the output layer."""
        out = []
        for k, layer in enumerate(self.layers):
            future = embedded[:, k]
            if self.sequence_parallel:
                future = mappings.scatter_to_sequence_parallel_region(future, self.tp_group)
            hidden = layer(hidden, future, documents, tracker)
            out.append(hidden)
        return tuple(out)
