"""One rank's experts of an MoE layer: SwiGLU FFNs as three stacked weights, run as grouped
GEMMs over rows sorted by expert (megatronish.ops.grouped_mm: a Triton kernel on CUDA, a
per-expert torch loop elsewhere).

Shapes: E_l local experts (global ids first .. first + E_l - 1), h d_model, f one expert's
d_ff, t tp. gate and up [E_l, f/t, h] (column-parallel), down [E_l, h, f/t] (row-parallel):
each expert's slice is exactly the nn.Linear weight of a dense SwiGLU MLP's block, so the
output [R, h] is a partial sum over the tp ranks (the caller all-reduces it).

Under train.precision fp8 (a plan with an fp8 recipe, given when it is built) the three
grouped GEMMs take fp8 operands, scaled per (expert, source) run of rows
(megatronish.fp8.grouped): the caller passes the dispatch's per-source counts.

Each weight's role (mark_experts) holds its per-expert full shape and tp split dim (those of
one expert's 2-D weight) and its global expert ids: checkpoints store every expert by global
id (blocks.<i>.mlp.experts.<e>.gate.weight, ...), the same at every tp and ep.
"""

from __future__ import annotations

import torch
from torch import nn

from megatronish import ops
from megatronish.fp8 import Split, fp8_experts
from megatronish.layers.linear import mark_parallel, to_autocast_dtype
from megatronish.layers.plan import PLAIN, LinearPlan
from megatronish.layers.roles import is_expert, role, set_role


def mark_experts(
    param: nn.Parameter, split_dim: int, full_shape: tuple[int, int], first: int
) -> None:
    """Tags a stacked expert weight [E_l, ...]: one expert's tp split dim and full 2-D shape,
    and the global ids of its experts."""
    mark_parallel(param, split_dim, full_shape)
    set_role(param, expert_ids=tuple(range(first, first + param.shape[0])))


class GroupedExperts(nn.Module):
    """plan: its numeric format (plan.recipe; plan.tokens the groups a micro-batch's tokens
    are split over); tp_group splits gate and up's outputs and down's inputs."""

    def __init__(
        self,
        num_local: int,
        first: int,
        d_model: int,
        d_ff: int,
        tp: int,
        backend,
        tp_group=None,
        plan: LinearPlan = PLAIN,
    ):
        super().__init__()
        local_ff = d_ff // tp
        self.backend = backend
        self.gate = nn.Parameter(torch.empty(num_local, local_ff, d_model))
        self.up = nn.Parameter(torch.empty(num_local, local_ff, d_model))
        self.down = nn.Parameter(torch.empty(num_local, d_model, local_ff))
        mark_experts(self.gate, 0, (d_ff, d_model), first)
        mark_experts(self.up, 0, (d_ff, d_model), first)
        mark_experts(self.down, 1, (d_model, d_ff), first)
        self.recipe, tokens = plan.recipe, plan.tokens
        self.fp8_splits = (Split(tp_group, "out", tokens), Split(tp_group, "in", tokens))

    def forward(
        self, x: torch.Tensor, offsets: torch.Tensor, sources: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [R, h] expert-major, offsets [E_l] each expert's cumulative end row -> [R, h]
        (this tp rank's partial sum). sources [E_l, S]: the rows of each expert from each
        source rank (needed under fp8)."""
        x = to_autocast_dtype(x)
        if self.recipe is not None:
            if sources is None:
                raise ValueError("fp8 experts scale per source rank: pass `sources`")
            return self._fp8(x, sources.tolist())
        gate, up, down = (to_autocast_dtype(w) for w in (self.gate, self.up, self.down))
        backend = self.backend
        g = ops.grouped_mm(x, gate.transpose(1, 2), offsets, backend=backend)  # [R, f/t]
        u = ops.grouped_mm(x, up.transpose(1, 2), offsets, backend=backend)
        hidden = ops.swiglu(g, u, backend=backend)
        return ops.grouped_mm(hidden, down.transpose(1, 2), offsets, backend=backend)

    def _fp8(self, x: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """The forward's GEMMs in fp8 on the fp32 weights (their casts kept for the step)."""
        recipe, (column, row) = self.recipe, self.fp8_splits
        g = fp8_experts(x, self.gate, counts, recipe, column)  # [R, f/t]
        u = fp8_experts(x, self.up, counts, recipe, column)
        hidden = ops.swiglu(g, u, backend=self.backend)
        return fp8_experts(hidden, self.down, counts, recipe, row)


def stored_tensors(named_parameters) -> list[tuple[str, nn.Parameter, int | None]]:
    """Every tensor a checkpoint stores, from (name, parameter) pairs: (name, param, None) for
    a plain parameter, and for stacked experts one (blocks.<i>.mlp.experts.<e>.<w>.weight,
    param, j) per local expert j of global id e; the tensor is param[j]."""
    out: list[tuple[str, nn.Parameter, int | None]] = []
    for name, param in named_parameters:
        if not is_expert(param):
            out.append((name, param, None))
            continue
        module, _, weight = name.rpartition(".")
        for j, expert in enumerate(role(param).expert_ids):
            out.append((f"{module}.{expert}.{weight}.weight", param, j))
    return out
