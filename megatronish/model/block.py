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
from megatronish.config import Config, Derived
from megatronish.context import Documents
from megatronish.distributed.layout import ParallelState, RNGTracker
from megatronish.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    shared_input_linears,
)
from megatronish.layers.plan import LinearPlan
from megatronish.model.attention import Attention
from megatronish.model.mla import LatentAttention
from megatronish.model.norm import Norm
from megatronish.moe import MoELayer


class MLP(nn.Module):
    """The dense MLP (d_ff: derived.d_ff unless given, e.g. an MoE layer's shared expert);
    plan: its linear layers' (megatronish.layers.plan)."""

    def __init__(
        self,
        cfg: Config,
        derived: Derived,
        ps: ParallelState,
        plan: LinearPlan,
        d_ff: int | None = None,
    ):
        super().__init__()
        model, sp, group = cfg.model, cfg.parallel.sequence_parallel, ps.tp_group
        d_ff = derived.d_ff if d_ff is None else d_ff
        self.is_llama, self.backend = not model.gpt2_block, cfg.kernels.backend
        common = dict(sequence_parallel=sp, tp_group=group, init_method=None, plan=plan)
        if self.is_llama:
            self.gate = ColumnParallelLinear(model.d_model, d_ff, bias=False, **common)
            self.up = ColumnParallelLinear(model.d_model, d_ff, bias=False, **common)
        else:
            self.up = ColumnParallelLinear(
                model.d_model, d_ff, bias=True, skip_bias_add=True, **common
            )
        self.down = RowParallelLinear(d_ff, model.d_model, bias=not self.is_llama, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_llama:
            gate, up = shared_input_linears(x, [self.gate, self.up])  # [b, s, f/t] each
            hidden = ops.swiglu(gate, up, backend=self.backend)
        elif ops.resolve_backend(self.backend, x) == "triton":  # the kernel adds the bias
            hidden = ops.bias_gelu(self.up(x), self.up.bias, backend="triton")
        else:  # torch adds the bias inside the matmul (addmm), as nn.Linear does
            hidden = ops.bias_gelu(self.up(x, add_bias=True), None, backend="torch")  # [b, s, f/t]
        return self.down(hidden)


class Block(nn.Module):
    """Transformer block `index`: attention, then a dense MLP, or a mixture of experts where
    index is one of derived.moe_layers. plan: the plan of its linear layers and experts
    (megatronish.model.plan's ModelPlan.blocks)."""

    def __init__(
        self,
        cfg: Config,
        derived: Derived,
        ps: ParallelState,
        tracker: RNGTracker,
        index: int,
        plan: LinearPlan,
    ):
        super().__init__()
        model, sp = cfg.model, cfg.parallel.sequence_parallel and derived.tp > 1
        kind = "layernorm" if model.gpt2_block else "rmsnorm"
        backend = cfg.kernels.backend
        self.norm1 = Norm(model.d_model, kind, model.norm_eps, backend, sp)
        attention = LatentAttention if model.attention == "mla" else Attention
        self.attn = attention(cfg, derived, ps, tracker, index, plan)
        self.norm2 = Norm(model.d_model, kind, model.norm_eps, backend, sp)
        if index in derived.moe_layers:
            d_ff = derived.shared_d_ff
            shared = MLP(cfg, derived, ps, plan, d_ff) if d_ff else None
            self.mlp = MoELayer(cfg, derived, ps, shared, plan)
        else:
            self.mlp = MLP(cfg, derived, ps, plan)
        self.dropout, self.tracker, self.sequence_parallel = model.dropout, tracker, sp

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
        return x + self._drop(self.mlp(self.norm2(x)))

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """forward for incremental decoding (eval: no dropout); see Attention.forward_cached
        (the cache: its keys and values) and LatentAttention.forward_cached (its latents)."""
        attn, cache = self.attn.forward_cached(self.norm1(x), cache, start_pos)
        x = x + attn
        return x + self.mlp(self.norm2(x)), cache
