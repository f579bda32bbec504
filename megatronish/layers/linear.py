"""Column- and row-parallel linear layers (Megatron-LM's split of Y = X A^T + b).

Shapes: b batch, s sequence, t tp group size; weights are [out, in] as in nn.Linear.
  ColumnParallelLinear  weight [out / t, in], bias [out / t]     input [b, s, in] (replicated)
                        output [b, s, out / t] (or [b, s, out] with gather_output)
  RowParallelLinear     weight [out, in / t], bias [out]         input [b, s, in / t]
                        output [b, s, out] (summed over the group), bias added once after it
With sequence_parallel the replicated activations are [b, s / t, h] instead: the column layer
all-gathers its input along the sequence, the row layer reduce-scatters its output.
Each layer's plan (megatronish.layers.plan), given when it is built, fixes its numeric format
and its communication schedule: with an fp8 recipe (megatronish.fp8) the three GEMMs take fp8
operands, the scales of tensors split over the group reduced over it, so every tp degree
computes the same; with overlap (parallel.tp_comm_overlap) the collectives are decomposed under
the GEMMs (megatronish.layers.overlap).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatronish.distributed import comm
from megatronish.fp8 import (
    Parts,
    Recipe,
    Split,
)
from megatronish.layers import mappings, overlap
from megatronish.layers.formats import to_autocast_dtype
from megatronish.layers.lora import ColumnAdapters, RowAdapter
from megatronish.layers.plan import PLAIN, LinearPlan, numeric_format
from megatronish.layers.roles import role, set_role

InitMethod = Callable[[torch.Tensor], None]


def normal_init(std: float = 0.02) -> InitMethod:
    """In-place normal(0, std) init of a full-size weight (uses the default generator)."""

    def init(tensor: torch.Tensor) -> None:
        nn.init.normal_(tensor, mean=0.0, std=std)

    return init


DEFAULT_INIT = normal_init(0.02)


def mark_parallel(param: nn.Parameter, split_dim: int | None, full_shape: tuple[int, ...]) -> None:
    """Sets param's role (layers.roles) of how it is split over the tp group: split_dim (None:
    replicated) and the full (unsplit) shape."""
    set_role(param, tp_split_dim=split_dim, full_shape=tuple(full_shape))


def init_sharded(
    param: nn.Parameter, init_method: InitMethod | None, split_dim: int, group
) -> None:
    """Initializes the full-size tensor and keeps this rank's block, so the same seed gives
    the same full weight at every tp."""
    if init_method is None:
        return
    full = torch.empty(role(param).full_shape, dtype=param.dtype, device=param.device)
    init_method(full)
    size, rank = comm.group_size(group), comm.group_rank(group)
    with torch.no_grad():
        param.copy_(full.chunk(size, dim=split_dim)[rank])


class _ColumnLinear(torch.autograd.Function):
    """X A^T + b whose backward all-reduces dX asynchronously while computing dA (or, with
    sequence parallelism, all-gathers X forward and reduce-scatters dX backward); the three
    GEMMs in the layer's numeric format (megatronish.layers.formats). A weight that needs no
    gradient (LoRA's frozen base) gets none: no dA GEMM, no input kept or gathered again for
    it."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, fmt, split):
        ctx.group, ctx.sequence_parallel, ctx.format = group, sequence_parallel, fmt
        ctx.split = split
        ctx.has_bias = bias is not None
        full_x = mappings.gather_seq(x, group) if sequence_parallel else x
        out, ctx.casts = fmt.forward(full_x, weight, bias, split)
        ctx.weight_grad = weight.requires_grad
        if ctx.weight_grad:
            ctx.save_for_backward(x if sequence_parallel else full_x)
        ctx.weight = weight  # itself (not a recompute's copy): the key of its fp8 casts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, group, fmt, split = ctx.weight, ctx.group, ctx.format, ctx.split
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_in, casts = fmt.grad_input(grad_out, weight, split, ctx.casts)
        handle = None
        if not ctx.sequence_parallel:
            grad_in = grad_in.contiguous()
            handle = comm.all_reduce(grad_in, group, async_op=True)
        grad_weight = None
        if ctx.weight_grad:  # the weight gradient overlaps the all-reduce
            (x,) = ctx.saved_tensors
            full_x = mappings.gather_seq(x, group) if ctx.sequence_parallel else x
            x_2d = full_x.reshape(-1, full_x.shape[-1])
            grad_weight = fmt.grad_weight(grad_2d, x_2d, weight, split, casts)
        grad_bias = grad_2d.sum(0).to(weight.dtype) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        if ctx.sequence_parallel:
            grad_in = mappings.reduce_scatter_seq(grad_in, group).contiguous()
        return grad_in, grad_weight, grad_bias, None, None, None, None


def local_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Recipe | None,
    split: Split,
) -> torch.Tensor:
    """x W^T + b on this rank, no collective of activations, in recipe's numeric format
    (megatronish.layers.formats; fp8: x in autocast's dtype, the scales reduced over split.group
    where the weight's split dim makes them span the ranks)."""
    return numeric_format(recipe).linear(x, weight, bias, split)


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    sequence_parallel: bool = False,
    plan: LinearPlan = PLAIN,
    out_parts: Parts | None = None,
) -> torch.Tensor:
    """x [b, s, in] (or [b, s / t, in] with sequence_parallel) times this rank's block of the
    weight [out / t, in]: [b, s, out / t]. Backward all-reduces dx over the group. plan.overlap
    with sequence_parallel: the all-gather decomposed under the GEMM (layers.overlap).
    out_parts: the logical matrices of the weight's rows (megatronish.fp8.parts; None: one)."""
    recipe, tokens = plan.recipe, plan.tokens
    if comm.group_size(group) == 1:
        return local_linear(x, weight, bias, recipe, Split(tokens=tokens, parts=out_parts))
    x = to_autocast_dtype(x)
    if plan.overlap and sequence_parallel:
        return overlap.all_gather_linear(
            x, [weight], [bias], group, recipe=recipe, tokens=tokens, parts=out_parts
        )[0]
    split = Split(group, "out", tokens, out_parts)
    fmt = numeric_format(recipe)
    return _ColumnLinear.apply(x, weight, bias, group, sequence_parallel, fmt, split)


def shared_input_linears(
    x: torch.Tensor, layers: Sequence[ColumnParallelLinear]
) -> list[torch.Tensor]:
    """x [b, s(/t), in] times each column layer's weight, + its bias (GPT-OSS's gate and up;
    after the GEMM, in the output's dtype): one gather (or copy) for all, so backward sums their
    input gradients once, as one fused layer would (llama's gate and up). Under their plan's
    overlap with sequence parallelism the gather is decomposed under the GEMMs, the gathered
    input kept for the weight gradients. The layers share their group, sequence parallelism
    and plan."""
    first = layers[0]
    settings = {(layer.tp_group, layer.sequence_parallel, layer.plan) for layer in layers}
    if len(settings) > 1:
        raise ValueError("shared_input_linears: the layers differ in group, sp or plan")
    x, group, plan = to_autocast_dtype(x), first.tp_group, first.plan
    adapted = any(layer.lora is not None for layer in layers)
    biases = [layer.bias for layer in layers]
    if first.sequence_parallel and plan.overlap and not adapted:
        weights, recipe, tokens = [layer.weight for layer in layers], plan.recipe, plan.tokens
        return list(
            overlap.all_gather_linear(
                x, weights, biases, group, keep_gathered=True, recipe=recipe, tokens=tokens
            )
        )
    x = mappings.to_tensor_parallel_region(x, group, first.sequence_parallel)  # [b, s, in]
    outs = [layer.local(x) for layer in layers]
    return [out if b is None else out + b.to(out.dtype) for out, b in zip(outs, biases)]


class ColumnParallelLinear(nn.Module):
    """Linear layer whose output features are split over the tp group (rank r holds the r-th
    contiguous block). Forward needs no communication (the input is replicated); backward
    all-reduces the input gradient, overlapped with the weight-gradient matmul. With
    skip_bias_add the bias is left for the caller to fuse into the next op. plan: its numeric
    format and communication schedule (megatronish.layers.plan). out_parts: the rows of each
    logical matrix fused in the weight, per repeating unit of its rows (the attention's q, k and
    v per key-value group; megatronish.fp8.parts): fp8 scales along the rows are taken per
    matrix. lora: its adapters (megatronish.layers.lora; the base weights frozen): the input is
    then copied (gathered) into the tp region once for base and adapters, and both run there."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        skip_bias_add: bool = False,
        init_method: InitMethod | None = DEFAULT_INIT,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        out_parts: tuple[int, ...] | None = None,
        plan: LinearPlan = PLAIN,
        lora: ColumnAdapters | None = None,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = comm.group_size(tp_group)
        self.skip_bias_add = skip_bias_add
        if out_features % self.tp_size:
            raise ValueError(f"out_features {out_features} not divisible by tp {self.tp_size}")
        if out_parts is not None and (out_features // self.tp_size) % sum(out_parts):
            units = f"whole units of out_parts {out_parts}"
            raise ValueError(f"out_features {out_features} / tp {self.tp_size} not {units}")
        self.out_parts = None if out_parts is None else Parts(tuple(out_parts))
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.plan = plan
        local_out = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype))
        mark_parallel(self.weight, 0, (out_features, in_features))
        init_sharded(self.weight, init_method, 0, tp_group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local_out, device=device, dtype=dtype))
            mark_parallel(self.bias, 0, (out_features,))
        else:
            self.register_parameter("bias", None)
        self.lora = lora

    def forward(self, x: torch.Tensor, add_bias: bool | None = None) -> torch.Tensor:
        """add_bias: whether the bias goes into the matmul (default: unless skip_bias_add)."""
        if add_bias is None:
            add_bias = not self.skip_bias_add
        bias = self.bias if add_bias else None
        if self.lora is not None:
            x = mappings.to_tensor_parallel_region(x, self.tp_group, self.sequence_parallel)
            out = self.local(to_autocast_dtype(x))
            out = out if bias is None else out + bias
        else:
            out = column_parallel_linear(
                x,
                self.weight,
                bias,
                self.tp_group,
                self.sequence_parallel,
                self.plan,
                self.out_parts,
            )
        if self.gather_output:
            out = mappings.gather_from_tensor_parallel_region(out, self.tp_group)
        return out

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, in], already in the tensor-parallel region (copied or gathered there by the
        caller), times this rank's weight: [b, s, out / t], no bias, no collective of
        activations; plus its adapters' output."""
        split = Split(self.tp_group, "out", self.plan.tokens, self.out_parts)
        out = local_linear(x, self.weight, None, self.plan.recipe, split)
        return out if self.lora is None else out + self.lora(x)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
            f"tp={self.tp_size}, bias={self.bias is not None}"
        )


class RowParallelLinear(nn.Module):
    """Linear layer whose input features are split over the tp group. Forward all-reduces the
    partial outputs (reduce-scatters them along the sequence with sequence_parallel); the bias
    is replicated and added once, after the reduction. plan: its numeric format and
    communication schedule (megatronish.layers.plan). lora: its adapter
    (megatronish.layers.lora; the base weights frozen), added before the bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        init_method: InitMethod | None = DEFAULT_INIT,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        plan: LinearPlan = PLAIN,
        lora: RowAdapter | None = None,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = comm.group_size(tp_group)
        if in_features % self.tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp {self.tp_size}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.plan = plan
        local_in = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, local_in, device=device, dtype=dtype))
        mark_parallel(self.weight, 1, (out_features, in_features))
        init_sharded(self.weight, init_method, 1, tp_group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
            mark_parallel(self.bias, None, (out_features,))
            # Under sequence parallelism each rank sees part of the sequence: the bias gradient
            # must be summed over the tp group (data parallelism does it for such parameters).
            set_role(self.bias, sequence_parallel_grad=sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.lora = lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.tp_group)
        out = self._base(x)
        return out if self.lora is None else out + self.lora(x)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, in / t] (parallel) times the weight, reduced over the group, plus the bias."""
        recipe, tokens = self.plan.recipe, self.plan.tokens
        split = Split(self.tp_group, "in", tokens)
        if self.tp_size == 1:
            return local_linear(x, self.weight, self.bias, recipe, split)
        if self.plan.overlap:  # the GEMM decomposed under its reduction (layers.overlap)
            group, sp = self.tp_group, self.sequence_parallel
            out = overlap.reduced_linear(x, self.weight, group, sp, recipe, tokens)
            return out if self.bias is None else out + self.bias
        partial = local_linear(x, self.weight, None, recipe, split)
        if self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            out = mappings.reduce_from_tensor_parallel_region(partial, self.tp_group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
            f"tp={self.tp_size}, bias={self.bias is not None}"
        )
