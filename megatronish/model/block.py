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
from megatronish.model.adapters import column_adapters, row_adapter
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
    shared expert): gated (SwiGLU, GeGLU or GPT-OSS's clamped SwiGLU) or GELU, with biases
    where plan.components has them."""

    def __init__(self, model: ModelConfig, plan: BlockPlan, d_ff: int | None = None):
        super().__init__()
        sp, group = plan.linear_sequence_parallel, plan.ps.tp_group
        d_ff = plan.derived.d_ff if d_ff is None else d_ff
        self.gated, self.backend = plan.components.gated_mlp, plan.backend
        self.activation, self.limit = plan.components.mlp, model.activation_limit
        bias = plan.components.linear_bias
        common = dict(sequence_parallel=sp, tp_group=group, init_method=None, plan=plan.linear)
        d_model = model.d_model

        def adapted(name: str) -> dict:
            # one logical matrix: d_ff units of one row
            return dict(lora=column_adapters(model, plan, d_model, {name: 1}, d_ff), **common)

        if self.gated:
            self.gate = ColumnParallelLinear(d_model, d_ff, bias=bias, **adapted("gate_proj"))
            self.up = ColumnParallelLinear(d_model, d_ff, bias=bias, **adapted("up_proj"))
        else:
            self.up = ColumnParallelLinear(
                d_model, d_ff, bias=bias, skip_bias_add=True, **adapted("up_proj")
            )
        down = row_adapter(model, plan, "down_proj", d_ff, d_model)
        self.down = RowParallelLinear(d_ff, d_model, bias=bias, lora=down, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = shared_input_linears(x, [self.gate, self.up])  # [b, s, f/t] each
            hidden = ops.activate(self.activation, gate, up, self.limit, backend=self.backend)
        elif ops.resolve_backend(self.backend, x) == "triton":  # the kernel adds the bias
            hidden = ops.bias_gelu(self.up(x), self.up.bias, backend="triton")
        else:  # torch adds the bias inside the matmul (addmm), as nn.Linear does
            hidden = ops.bias_gelu(self.up(x, add_bias=True), None, backend="torch")  # [b, s, f/t]
        return self.down(hidden)


class Block(nn.Module):
    """Transformer block plan.index (megatronish.model.plan): attention, then a dense MLP, or a
    mixture of experts where plan.moe; under sandwich norms each sublayer's output is normed
    (attn_out_norm, mlp_out_norm) before the residual add."""

    def __init__(self, model: ModelConfig, plan: BlockPlan):
        super().__init__()
        self.norm1 = hidden_norm(model, plan)
        self.attn = ATTENTION[plan.attention](model, plan)
        self.norm2 = hidden_norm(model, plan)
        self.attn_out_norm = self.mlp_out_norm = None
        if plan.components.sandwich_norms:  # the sublayers' outputs normed too (Gemma 3)
            self.attn_out_norm = hidden_norm(model, plan)
            self.mlp_out_norm = hidden_norm(model, plan)
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

    def _mlp(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The MLP's branch of x [b, s, h]: norm, MLP (and its output's norm if sandwiched);
        a mixture of experts reads the documents' routes (routing replay)."""
        if isinstance(self.mlp, MoELayer):
            out = self.mlp(self.norm2(x), documents)
        else:
            out = self.mlp(self.norm2(x))
        return out if self.mlp_out_norm is None else self.mlp_out_norm(out)

    def _attention_out(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.attn_out_norm is None else self.attn_out_norm(out)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; documents: this rank's tokens' under document masks."""
        x = x + self._drop(self._attention_out(self.attn(self.norm1(x), documents)))
        return x + self._drop(self._mlp(x, documents))

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """forward for incremental decoding (eval: no dropout); see Attention.forward_cached
        (the cache: its keys and values) and LatentAttention.forward_cached (its latents)."""
        attn, cache = self.attn.forward_cached(self.norm1(x), cache, start_pos)
        x = x + self._attention_out(attn)
        return x + self._mlp(x), cache
