"""Low-rank adapters (LoRA, Hu et al. 2021) beside a frozen parallel linear layer:
y = base(x) + (alpha / r) B A dropout(x), A [r, in] initialized as peft does (kaiming-uniform,
a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B [out, r] zero, in the training precision (under fp8
only the base GEMM is fp8).

Shapes: b batch, s sequence (s / t under sequence parallelism), t tp group size, r rank.
  ColumnAdapters  one adapter per logical matrix of the layer's rows (the fused qkv: q, k and v);
                  A [r, in] whole on every rank (its gradient summed over the group: each rank's
                  covers its rows of B), B [out_part / t, r] split with the base rows
                  input [b, s, in] in the tp region, output [b, s, out / t]
  RowAdapter      A [r, in / t] split with the base columns, B [out, r] whole
                  input [b, s, in / t]; A x summed over the group (reduce-scattered along the
                  sequence under sequence parallelism), output [b, s(/t), out]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.distributed import comm
from megatronish.layers import mappings
from megatronish.layers.roles import set_role


@dataclass(frozen=True)
class Lora:
    """One layer's adapter settings (model.lora): rank r, scale alpha / r, input dropout."""

    rank: int
    alpha: float
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


ADAPTER_PARAMS = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether the parameter (or stored tensor) `name` is an adapter's A or B."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def _adapter_params(rank: int, d_in: int, d_out: int, device, dtype) -> nn.ParameterDict:
    """lora_A [r, d_in] (peft's init: see init_adapter) and lora_B [d_out, r] zero: local
    shapes; the caller sets their roles."""
    a = nn.Parameter(torch.empty(rank, d_in, device=device, dtype=dtype))
    b = nn.Parameter(torch.zeros(d_out, rank, device=device, dtype=dtype))
    set_role(b, init_fill=0.0)
    return nn.ParameterDict({"lora_A": a, "lora_B": b})


def init_adapter_a(full: torch.Tensor, generator: torch.Generator) -> None:
    """peft's init of a full A [r, in]: kaiming_uniform_(a=sqrt(5)), U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / full.shape[1] ** 0.5
    full.uniform_(-bound, bound, generator=generator)


def _down(x: torch.Tensor, a: torch.Tensor, lora: Lora, training: bool) -> torch.Tensor:
    x = F.dropout(x, lora.dropout, training) if lora.dropout else x
    return F.linear(x, a.to(x.dtype))


class ColumnAdapters(nn.Module):
    """The adapters of a column-parallel layer whose rows repeat `units` times a unit of logical
    parts (parts: name -> rows of that part per unit, in the unit's order; the qkv: per key-value
    group q_proj's heads, k_proj's, v_proj's). Parts not in `targets` get no adapter."""

    def __init__(
        self,
        lora: Lora,
        d_in: int,
        parts: dict[str, int],
        units: int,
        targets: tuple[str, ...],
        group,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.lora, self.parts, self.group = lora, dict(parts), group
        tp, rank = comm.group_size(group), lora.rank
        if units % tp:
            raise ValueError(f"ColumnAdapters: {units} units not divisible by tp {tp}")
        self.local_units = units // tp
        self.adapters = nn.ModuleDict()
        for name, rows in parts.items():
            if name not in targets:
                continue
            params = _adapter_params(rank, d_in, self.local_units * rows, device, dtype)
            set_role(params["lora_A"], full_shape=(rank, d_in), sequence_parallel_grad=tp > 1)
            set_role(params["lora_B"], tp_split_dim=0, full_shape=(units * rows, rank))
            self.adapters[name] = params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, in] in the tp region -> the adapters' sum [b, s, local out] in the layer's
        row order (zero in the rows of parts without an adapter)."""
        pieces = []
        for name, rows in self.parts.items():
            shape = (*x.shape[:-1], self.local_units, rows)
            if name not in self.adapters:
                pieces.append(x.new_zeros(shape))
                continue
            params = self.adapters[name]
            hidden = _down(x, params["lora_A"], self.lora, self.training)
            out = F.linear(hidden, params["lora_B"].to(x.dtype)) * self.lora.scale
            pieces.append(out.view(shape))
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return out.flatten(-2)


class RowAdapter(nn.Module):
    """The adapter of a row-parallel layer [out, in]: A split with the base columns, B whole.
    Its input dropout draws from `tracker`'s tensor-parallel stream (the input differs per tp
    rank; a column layer's adapters take the default stream, their input being replicated)."""

    def __init__(
        self,
        lora: Lora,
        d_in: int,
        d_out: int,
        group,
        sequence_parallel: bool,
        tracker=None,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.lora, self.group, self.sequence_parallel = lora, group, sequence_parallel
        self.tracker = tracker
        tp, rank = comm.group_size(group), lora.rank
        self.adapter = _adapter_params(rank, d_in // tp, d_out, device, dtype)
        set_role(self.adapter["lora_A"], tp_split_dim=1, full_shape=(rank, d_in))
        set_role(self.adapter["lora_B"], full_shape=(d_out, rank))
        set_role(self.adapter["lora_B"], sequence_parallel_grad=sequence_parallel and tp > 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, in / t] -> [b, s(/t), out]: A x summed over the group, then B."""
        parallel = comm.group_size(self.group) > 1
        if parallel and self.lora.dropout and self.training and self.tracker is not None:
            with self.tracker.fork():
                hidden = _down(x, self.adapter["lora_A"], self.lora, self.training)
        else:
            hidden = _down(x, self.adapter["lora_A"], self.lora, self.training)  # [b, s, r] partial
        if parallel:
            if self.sequence_parallel:
                hidden = mappings.reduce_scatter_to_sequence_parallel_region(hidden, self.group)
            else:
                hidden = mappings.reduce_from_tensor_parallel_region(hidden, self.group)
        return F.linear(hidden, self.adapter["lora_B"].to(x.dtype)) * self.lora.scale
