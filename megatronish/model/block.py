"""One transformer block: norms, attention and the MLP (dense or mixture of experts), with the
residual dropout (drawn from the RNG tracker inside tensor-parallel regions).

Shapes (legend in megatronish.model): b batch, s sequence (s / t under sequence
parallelism), h d_model, f d_ff, t tp size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatronish import ops
from megatronish.config import ModelConfig
from megatronish.context import Documents
from megatronish.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    shared_input_linears,
)
from megatronish.model.attention import Attention
from megatronish.model.gated_deltanet import GatedDeltaNet
from megatronish.model.mla import LatentAttention
from megatronish.model.norm import hidden_norm
from megatronish.model.plan import BlockPlan
from megatronish.moe import MoELayer

ATTENTION: dict[str, type[nn.Module]] = {
    "mha": Attention,
    "mla": LatentAttention,
    "gated_deltanet": GatedDeltaNet,
}
"""The attention module of each attention component (megatronish.config.components)."""


class MLP(nn.Module):
    """The dense MLP of plan's block (d_ff: derived.d_ff unless given, e.g. an MoE layer's
    shared expert): gated (SwiGLU) or GELU, with biases where plan.components has them."""

    def __init__(self, model: ModelConfig, plan: BlockPlan, d_ff: int | None = None):
        super().__init__()
        sp, group = plan.linear_sequence_parallel, plan.ps.tp_group
        d_ff = plan.derived.d_ff if d_ff is None else d_ff
        self.gated, self.backend = plan.components.gated_mlp, plan.backend
        bias = plan.components.linear_bias
        common = dict(sequence_parallel=sp, tp_group=group, init_method=None, plan=plan.linear)
        if self.gated:
            self.gate = ColumnParallelLinear(model.d_model, d_ff, bias=bias, **common)
            self.up = ColumnParallelLinear(model.d_model, d_ff, bias=bias, **common)
        else:
            self.up = ColumnParallelLinear(
                model.d_model, d_ff, bias=bias, skip_bias_add=True, **common
            )
        self.down = RowParallelLinear(d_ff, model.d_model, bias=bias, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = shared_input_linears(x, [self.gate, self.up])  # [b, s, f/t] each
            hidden = ops.swiglu(gate, up, backend=self.backend)
        elif ops.resolve_backend(self.backend, x) == "triton":  # the kernel adds the bias
            hidden = ops.bias_gelu(self.up(x), self.up.bias, backend="triton")
        else:  # torch adds the bias inside the matmul (addmm), as nn.Linear does
            hidden = ops.bias_gelu(self.up(x, add_bias=True), None, backend="torch")  # [b, s, f/t]
        return self.down(hidden)


class Block(nn.Module):
    """Transformer block plan.index (megatronish.model.plan): attention, then a dense MLP, or a
    mixture of experts where plan.moe."""

    def __init__(self, model: ModelConfig, plan: BlockPlan):
        super().__init__()
        self.norm1 = hidden_norm(model, plan)
        self.attn = ATTENTION[plan.attention](model, plan)
        self.norm2 = hidden_norm(model, plan)
        if plan.moe:
            d_ff = plan.derived.shared_d_ff
            shared = MLP(model, plan, d_ff) if d_ff else None
            sp, derived = plan.sequence_parallel, plan.derived
            self.mlp = MoELayer(
                model, derived, plan.ps, plan.linear, plan.backend, sp, shared, plan.index
            )
        else:
            self.mlp = MLP(model, plan)
        self.dropout, self.tracker = model.dropout, plan.tracker
        self.sequence_parallel = plan.sequence_parallel

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout == 0 or not self.training:
            return x
        if self.sequence_parallel:  # each tp rank holds different tokens
            with self.tracker.fork():
                return F.dropout(x, self.dropout, training=True)
        return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; documents: this rank's tokens' under document masks."""
        x = x + self._drop(self.attn(self.norm1(x), documents))
        if isinstance(self.mlp, MoELayer):  # routing replay reads the documents' routes
            return x + self._drop(self.mlp(self.norm2(x), documents))
        return x + self._drop(self.mlp(self.norm2(x)))

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """forward for incremental decoding (eval: no dropout); see Attention.forward_cached
        (the cache: its keys and values) and LatentAttention.forward_cached (its latents)."""
        attn, cache = self.attn.forward_cached(self.norm1(x), cache, start_pos)
        x = x + attn
        return x + self.mlp(self.norm2(x)), cache
