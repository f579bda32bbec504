"""The norms: LayerNorm (gpt2) or RMSNorm (llama) over the hidden size, and (model.qk_norm) the
RMSNorm of each attention head's query and key over the head dim; each scales by its weight, or
by 1 + its weight (zero-initialized) where the components' norm_offset is 1 (Qwen3.5, Gemma 3),
the 1 added in fp32 inside ops.rms_norm as transformers does."""

from __future__ import annotations

import torch
from torch import nn

from megatronish import ops
from megatronish.config import ModelConfig
from megatronish.layers.linear import mark_parallel
from megatronish.layers.roles import set_role
from megatronish.model.plan import BlockPlan


class Norm(nn.Module):
    """LayerNorm (gpt2) or RMSNorm (llama) over h; its parameters are replicated on tp ranks."""

    def __init__(
        self,
        dim: int,
        kind: str,
        eps: float,
        backend: str,
        sequence_parallel: bool,
        offset: float = 0.0,
    ):
        super().__init__()
        self.kind, self.eps, self.backend, self.offset = kind, eps, backend, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        mark_parallel(self.weight, None, (dim,))
        set_role(self.weight, sequence_parallel_grad=sequence_parallel, init_fill=1.0 - offset)
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.zeros(dim))
            mark_parallel(self.bias, None, (dim,))
            set_role(self.bias, sequence_parallel_grad=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return ops.layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)
        return ops.rms_norm(x, self.weight, self.eps, backend=self.backend, offset=self.offset)


def hidden_norm(model: ModelConfig, plan: BlockPlan) -> Norm:
    """A norm over d_model of plan's block: its norm component, on this rank's tokens."""
    kind, sp = plan.components.norm, plan.sequence_parallel
    return Norm(model.d_model, kind, model.norm_eps, plan.backend, sp, plan.components.norm_offset)
