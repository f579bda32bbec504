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

With biases (GPT-OSS: biased=True) each expert also has gate and up biases [E_l, f/t] (split
with their rows) and a down bias [E_l, h/t], split over tp along h: each rank adds its columns'
part to its partial sum, so the sum over tp adds each bias once. With a
limit the activation is GPT-OSS's clamped SwiGLU (ops.activate).

Each weight's role (mark_experts) holds its per-expert full shape and tp split dim (those of
one expert's 2-D weight) and its global expert ids: checkpoints store every expert by global
id (blocks.<i>.mlp.experts.<e>.gate.weight, ... .gate.bias), the same at every tp and ep.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megatronish import ops
from megatronish.distributed import comm
from megatronish.fp8 import Split, fp8_experts
from megatronish.layers.linear import mark_parallel, to_autocast_dtype
from megatronish.layers.plan import PLAIN, LinearPlan
from megatronish.layers.roles import is_expert, role, set_role


def mark_experts(
    param: nn.Parameter, split_dim: int | None, full_shape: tuple[int, ...], first: int
) -> None:
    """Tags a stacked expert weight [E_l, ...]: one expert's tp split dim and full shape, and
    the global ids of its experts."""
    mark_parallel(param, split_dim, full_shape)
    set_role(param, expert_ids=tuple(range(first, first + param.shape[0])))


def row_bias(bias: torch.Tensor, offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """bias [E_l, n] repeated for each expert's rows (offsets [E_l] cumulative ends) -> [R, n]."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return bias.repeat_interleave(counts, dim=0, output_size=rows)


class GroupedExperts(nn.Module):
    """plan: its numeric format (plan.recipe; plan.tokens the groups a micro-batch's tokens
    are split over); tp_group splits gate and up's outputs and down's inputs. limit: the
    clamped SwiGLU's (None: SwiGLU); biased: the experts' biases."""

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
        limit: float | None = None,
        biased: bool = False,
        lora: nn.Module | None = None,
    ):
        super().__init__()
        self.lora = lora  # moe.adapters.ExpertAdapters (model.lora's expert targets) or None
        local_ff = d_ff // tp
        self.backend, self.limit = backend, limit
        self.gate = nn.Parameter(torch.empty(num_local, local_ff, d_model))
        self.up = nn.Parameter(torch.empty(num_local, local_ff, d_model))
        self.down = nn.Parameter(torch.empty(num_local, d_model, local_ff))
        mark_experts(self.gate, 0, (d_ff, d_model), first)
        mark_experts(self.up, 0, (d_ff, d_model), first)
        mark_experts(self.down, 1, (d_model, d_ff), first)
        self.gate_bias = self.up_bias = self.down_bias = None
        if biased:
            self.gate_bias = nn.Parameter(torch.zeros(num_local, local_ff))
            self.up_bias = nn.Parameter(torch.zeros(num_local, local_ff))
            self.down_bias = nn.Parameter(torch.zeros(num_local, d_model // tp))
            mark_experts(self.gate_bias, 0, (d_ff,), first)
            mark_experts(self.up_bias, 0, (d_ff,), first)
            mark_experts(self.down_bias, 0, (d_model,), first)
        self.first_column = (d_model // tp) * (comm.group_rank(tp_group) if tp > 1 else 0)
        self.recipe, tokens = plan.recipe, plan.tokens
        self.fp8_splits = (Split(tp_group, "out", tokens), Split(tp_group, "in", tokens))

    def forward(
        self, x: torch.Tensor, offsets: torch.Tensor, sources: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [R, h] expert-major, offsets [E_l] each expert's cumulative end row -> [R, h]
        (this tp rank's partial sum). sources [E_l, S]: the rows of each expert from each
        source rank (needed under fp8)."""
        x = to_autocast_dtype(x)
        counts = None
        if self.recipe is not None:
            if sources is None:
                raise ValueError("fp8 experts scale per source rank: pass `sources`")
            counts = sources.tolist()
        matmul = partial(self._matmul, offsets=offsets, counts=counts)
        g = self._biased(matmul(x, "gate"), self.gate_bias, offsets)  # [R, f/t]
        u = self._biased(matmul(x, "up"), self.up_bias, offsets)
        lora = self.lora
        delta = None if lora is None else lora.gate_up_delta(x, offsets, self.backend)
        if delta is not None:
            g, u = g + delta[0], u + delta[1]
        kind = "swiglu" if self.limit is None else "clamped_swiglu"
        hidden = ops.activate(kind, g, u, self.limit, backend=self.backend)
        out = self._biased(matmul(hidden, "down"), self.down_bias, offsets)  # [R, h]
        delta = None if lora is None else lora.down_delta(hidden, offsets, self.backend)
        return out if delta is None else out + delta

    def _matmul(
        self, rows: torch.Tensor, name: str, offsets: torch.Tensor, counts: list | None
    ) -> torch.Tensor:
        """rows times each row's expert's weight `name` (gate, up or down): grouped GEMMs, or
        under fp8 (counts: the rows per expert and source) fp8 ones on the fp32 weight (its
        cast kept for the step)."""
        weight = getattr(self, name)
        if counts is not None:
            split = self.fp8_splits[name == "down"]
            return fp8_experts(rows, weight, counts, self.recipe, split)
        weight = to_autocast_dtype(weight).transpose(1, 2)
        return ops.grouped_mm(rows, weight, offsets, backend=self.backend)

    def _biased(
        self, y: torch.Tensor, bias: torch.Tensor | None, offsets: torch.Tensor
    ) -> torch.Tensor:
        """y [R, n] plus each row's expert's bias (none where bias is None); the down bias
        [E_l, h/t] on this rank's columns of h."""
        if bias is None:
            return y
        rows = row_bias(to_autocast_dtype(bias), offsets, y.shape[0])
        if rows.shape[1] != y.shape[1]:
            first = self.first_column
            rows = F.pad(rows, (first, y.shape[1] - first - rows.shape[1]))
        return y + rows


def stored_tensors(named_parameters) -> list[tuple[str, nn.Parameter, int | None]]:
    """Every tensor a checkpoint stores, from (name, parameter) pairs: (name, param, None) for
    a plain parameter, and for stacked experts one (blocks.<i>.mlp.experts.<e>.<w>.weight, or
    .<w>.bias for <w>_bias, param, j) per local expert j of global id e; the tensor is
    param[j]. The experts' LoRA adapters (moe.adapters) are stored as
    blocks.<i>.mlp.experts.<e>.<adapter>.lora_A (or lora_B)."""
    out: list[tuple[str, nn.Parameter, int | None]] = []
    for name, param in named_parameters:
        if not is_expert(param):
            out.append((name, param, None))
            continue
        if ".lora." in name:  # <experts>.lora.<adapter>.lora_A
            experts, _, adapter = name.partition(".lora.")
            ids = role(param).expert_ids
            out += [(f"{experts}.{e}.{adapter}", param, j) for j, e in enumerate(ids)]
            continue
        module, _, weight = name.rpartition(".")
        weight, kind = (
            (weight[: -len("_bias")], "bias") if weight.endswith("_bias") else (weight, "weight")
        )
        for j, expert in enumerate(role(param).expert_ids):
            out.append((f"{module}.{expert}.{weight}.{kind}", param, j))
    return out
