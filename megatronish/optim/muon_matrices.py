"""Which parameters Muon updates and the logical matrices in each: every 2-D weight matrix
inside the blocks and the multi-token prediction modules (the linears' weights, fused q, k and
v taken apart by their out_parts, each expert of a stacked weight separately); AdamW takes
the rest (embeddings, the output layer, norms, biases, routers, the shared experts' gate, the
linear-attention convolution)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatronish.fp8.parts import Parts
from megatronish.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatronish.layers.roles import role
from megatronish.model.mla import ReplicatedLinear
from megatronish.moe.experts import GroupedExperts

LINEARS = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, nn.Linear)


@dataclass(frozen=True)
class Matrix:
    """One logical matrix of a Muon parameter, as this rank holds it: `expert` the index in
    dim 0 of a stacked expert weight (None: the parameter is 2-D), `part` its place among
    out_parts (None: every row), `split_dim` the dim of the 2-D matrix split over tp (None:
    whole on every tp rank)."""

    param: nn.Parameter
    expert: int | None
    part: int | None
    parts: Parts | None
    split_dim: int | None

    def block(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of the matrix's local block of `tensor` (param-shaped): [rows, cols], or of a
        fused layer's part [units, rows per unit, cols] (its rows in order)."""
        block = tensor if self.expert is None else tensor[self.expert]
        if self.part is None:
            return block
        sizes, cols = self.parts.sizes, block.shape[-1]
        start = sum(sizes[: self.part])
        return block.view(-1, sum(sizes), cols)[:, start : start + sizes[self.part]]

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The matrix's local block of `tensor` as [rows, cols] (a copy for a fused part)."""
        block = self.block(tensor)
        return block.reshape(-1, block.shape[-1])


def muon_matrices(model: nn.Module) -> list[Matrix]:
    """The logical matrices Muon updates, in the model's parameter order (a parameter's first)."""
    matrices: list[Matrix] = []
    for top in (getattr(model, "blocks", None), getattr(model, "mtp", None)):
        if top is None:
            continue
        for module in top.modules():
            if isinstance(module, LINEARS):
                parts = getattr(module, "out_parts", None)
                matrices += _of(module.weight, parts)
            elif isinstance(module, GroupedExperts):
                for param in (module.gate, module.up, module.down):
                    matrices += _of(param, None)
    return [m for m in matrices if m.param.requires_grad]


def _of(param: nn.Parameter, parts: Parts | None) -> list[Matrix]:
    """The matrices of one parameter: per expert (stacked), per part (fused rows)."""
    split = role(param).tp_split_dim
    experts = range(param.shape[0]) if param.dim() == 3 else [None]
    pieces = range(len(parts.sizes)) if parts is not None else [None]
    return [Matrix(param, e, k, parts, split) for e in experts for k in pieces]
