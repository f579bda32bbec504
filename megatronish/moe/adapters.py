"""LoRA adapters (model.lora: megatronish.layers.lora) on one rank's grouped experts, as peft
adapts transformers' fused experts (LoraConfig.target_parameters experts.gate_up_proj and
experts.down_proj): per expert one adapter over gate and up together and one over down, the
scale alpha / r, the base experts frozen.

Shapes: E_l local experts, h d_model, f one expert's d_ff, t tp, r rank, R rows (expert-major).
  gate_up  A [E_l, r, h] whole on every tp rank (its gradient summed over tp: each rank's covers
           its rows of B), B as gate's rows and up's rows, [E_l, f/t, r] each, split with the
           experts' gate and up
  down     A [E_l, r, f/t] split with down's columns, B [E_l, h, r] whole: B A x is a partial sum
           over tp as the experts' own output is (the caller's all-reduce sums it), so B's
           gradient is summed over tp
Every tensor is an expert weight (moe.experts.mark_experts): stored by global expert id, split
over ep, its gradient reduced over the expert-data-parallel group.
"""

from __future__ import annotations

import torch
from torch import nn

from megatronish import ops
from megatronish.config import Derived
from megatronish.config.lora import LoraConfig
from megatronish.layers.linear import to_autocast_dtype
from megatronish.layers.lora import Lora
from megatronish.layers.roles import set_role
from megatronish.moe.experts import mark_experts

# The targets (peft's target_parameters) and the adapters each makes.
GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"


class ExpertAdapters(nn.Module):
    """The adapters of the targets among GATE_UP and DOWN (module paths gate_up.lora_A,
    gate.lora_B, up.lora_B; down.lora_A, down.lora_B)."""

    def __init__(
        self,
        lora: Lora,
        targets: tuple[str, ...],
        num_local: int,
        first: int,
        d_model: int,
        d_ff: int,
        tp: int,
    ):
        super().__init__()
        self.lora, r, f, h = lora, lora.rank, d_ff, d_model

        def param(shape, split_dim, full, zero=False, summed=False) -> nn.Parameter:
            made = nn.Parameter(torch.zeros(num_local, *shape))
            mark_experts(made, split_dim, full, first)
            set_role(made, sequence_parallel_grad=summed and tp > 1)
            if zero:
                set_role(made, init_fill=0.0)
            return made

        self.gate_up = self.gate = self.up = self.down = None
        if GATE_UP in targets:
            self.gate_up = nn.ParameterDict({"lora_A": param((r, h), None, (r, h), summed=True)})
            self.gate = nn.ParameterDict({"lora_B": param((f // tp, r), 0, (f, r), zero=True)})
            self.up = nn.ParameterDict({"lora_B": param((f // tp, r), 0, (f, r), zero=True)})
        if DOWN in targets:
            self.down = nn.ParameterDict(
                {
                    "lora_A": param((r, f // tp), 1, (r, f)),
                    "lora_B": param((h, r), None, (h, r), zero=True, summed=True),
                }
            )

    def gate_up_delta(
        self, x: torch.Tensor, offsets: torch.Tensor, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [R, h] -> the adapter's (gate [R, f/t], up [R, f/t]) terms; None without it."""
        if self.gate_up is None:
            return None
        hidden = self._grouped(x, self.gate_up["lora_A"], offsets, backend)  # [R, r]
        gate = self._grouped(hidden, self.gate["lora_B"], offsets, backend)
        up = self._grouped(hidden, self.up["lora_B"], offsets, backend)
        return gate * self.lora.scale, up * self.lora.scale

    def down_delta(
        self, hidden: torch.Tensor, offsets: torch.Tensor, backend: str
    ) -> torch.Tensor | None:
        """hidden [R, f/t] -> the adapter's term [R, h] (a partial sum over tp); None without."""
        if self.down is None:
            return None
        low = self._grouped(hidden, self.down["lora_A"], offsets, backend)  # [R, r] partial
        return self._grouped(low, self.down["lora_B"], offsets, backend) * self.lora.scale

    @staticmethod
    def _grouped(rows: torch.Tensor, weight: torch.Tensor, offsets, backend) -> torch.Tensor:
        """rows times each row's expert's weight [E_l, out, in] transposed: [R, out]."""
        weight = to_autocast_dtype(weight).transpose(1, 2)
        return ops.grouped_mm(rows, weight, offsets, backend=backend)


def expert_adapters(
    spec: LoraConfig | None, num_local: int, first: int, d_model: int, derived: Derived
) -> ExpertAdapters | None:
    """The adapters of model.lora's expert targets on a rank's experts (None: no such target)."""
    targets = tuple(t for t in (GATE_UP, DOWN) if spec is not None and t in spec.targets)
    if not targets:
        return None
    lora = Lora(spec.rank, spec.alpha, spec.dropout)
    return ExpertAdapters(lora, targets, num_local, first, d_model, derived.moe_d_ff, derived.tp)
