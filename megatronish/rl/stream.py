"""The policy's weights streamed out in Hugging Face names, one bucket at a time.

The plan, the same on every rank: every saved tensor of the whole model (checkpoint.format's
all_stage_specs, gathered over the ep and pp groups) in units, a unit being the tensors that
one Hugging Face tensor is made of (found by running the family's mapping once on shape-only
tensors that carry their sources), and the units, in order, in buckets of about bucket_bytes
(a unit larger than that is a bucket alone).

Each bucket: its tensors made whole over dp under ZeRO-3 (the level's whole_params for the
bucket's parameters alone: the ZeRO buckets that hold them are gathered, and freed once the
bucket is copied out) and over tp (an all-gather along the split dim, vocab padding dropped),
then brought to rank 0 (all_gather_object over the ep group, then the pp group); rank 0 maps
them as `megatronish export` does (hf.exporter.hf_tensors) with shape-only stand-ins for the
rest of the model, yields the bucket and drops it. So rank 0 holds one bucket's tensors (in
our names and in theirs) at a time, bitwise the export's, and under ZeRO-3 every rank holds
about one bucket's parameters whole beyond its shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from megatronish.checkpoint.format import all_stage_specs, saved_tensors
from megatronish.config import Config
from megatronish.data_parallel import DataParallel
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.hf.exporter import hf_tensors
from megatronish.hf.importer import one_process
from megatronish.layers.roles import role

FLOAT32_BYTES = 4


class _Sourced(torch.Tensor):
    """A shape-only (meta) tensor that carries the names of the tensors it was computed from."""

    sources: frozenset = frozenset()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        found: set = set()
        for arg in [*args, *(kwargs or {}).values()]:
            for item in arg if isinstance(arg, list | tuple) else [arg]:
                if isinstance(item, _Sourced):
                    found |= item.sources
        out = super().__torch_function__(func, types, args, kwargs or {})
        for item in out if isinstance(out, list | tuple) else [out]:
            if isinstance(item, _Sourced):
                item.sources = frozenset(found)
        return out


def _stand_in(name: str, shape: tuple[int, ...]) -> _Sourced:
    tensor = torch.empty(shape, device="meta").as_subclass(_Sourced)
    tensor.sources = frozenset({name})
    return tensor


class Bucket(NamedTuple):
    ours: list[str]  # our tensor names
    theirs: list[str]  # the Hugging Face names made of them


def plan(cfg: Config, shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> list[Bucket]:
    """Our tensors (whole shapes `shapes`, in order) in buckets of whole units, each of at
    most bucket_bytes in float32 unless it is one unit alone."""
    one_cfg, one_derived = one_process(cfg)
    mapped = hf_tensors(one_cfg, one_derived, {n: _stand_in(n, s) for n, s in shapes.items()})
    sources = {name: sorted(getattr(t, "sources", ())) for name, t in mapped.items()}
    unit_of = {name: name for name in shapes}

    def root(name: str) -> str:
        while unit_of[name] != name:
            name = unit_of[name]
        return name

    for names in sources.values():
        for name in names[1:]:
            unit_of[root(name)] = root(names[0])
    units: dict[str, list[str]] = {}
    for name in shapes:
        units.setdefault(root(name), []).append(name)
    buckets: list[list[str]] = [[]]
    size = 0
    for names in units.values():
        unit_size = sum(FLOAT32_BYTES * _numel(shapes[n]) for n in names)
        if buckets[-1] and size + unit_size > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(names)
        size += unit_size
    bucket_of = {name: k for k, names in enumerate(buckets) for name in names}
    theirs: list[list[str]] = [[] for _ in buckets]
    for hf_name, names in sources.items():  # one made of nothing goes with the first bucket
        theirs[bucket_of[names[0]] if names else 0].append(hf_name)
    return [Bucket(ours, hf_names) for ours, hf_names in zip(buckets, theirs, strict=True)]


def hf_buckets(
    model: nn.Module, cfg: Config, optimizer: DataParallel, bucket_mb: float
) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket's (Hugging Face name -> fp32 CPU tensor) on rank 0; every rank iterates
    (the others get nothing) since the gathering is collective."""
    ps: ParallelState = model.ps
    specs = all_stage_specs(model, ps)
    shapes = {name: tuple(spec.real_shape()) for name, spec in specs.items()}
    local = {name: (param, index) for name, param, index in saved_tensors(model)}
    one_cfg, one_derived = one_process(cfg)
    for bucket in plan(cfg, shapes, int(bucket_mb * 2**20)):
        params = [local[name][0] for name in bucket.ours if name in local]
        with optimizer.whole_params(params=params):  # ZeRO-3: this bucket's, then freed
            ours = _bucket_on_rank0(bucket.ours, local, ps)
        if not ps.is_main:
            continue
        stand_ins = {n: _stand_in(n, s) for n, s in shapes.items() if n not in ours}
        mapped = hf_tensors(one_cfg, one_derived, {**stand_ins, **ours})
        del ours, stand_ins
        yield {name: mapped[name] for name in bucket.theirs}


@torch.no_grad()
def _bucket_on_rank0(
    names: list[str], local: dict[str, tuple[nn.Parameter, int | None]], ps: ParallelState
) -> dict[str, torch.Tensor]:
    """The bucket's whole, unpadded tensors by our name on rank 0 ({} elsewhere)."""
    part: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in local:
            continue
        param, index = local[name]
        tensor = param.detach() if index is None else param.detach()[index]
        spec = role(param)
        if spec.tp_split_dim is not None and ps.tp > 1:
            tensor = _tp_whole(tensor, spec.tp_split_dim, ps)
        if spec.valid_rows is not None:
            tensor = tensor[: spec.valid_rows]
        sends = index is not None or ps.dp_rank == 0  # one copy of what the ep ranks share
        if ps.tp_rank == 0 and ps.cp_rank == 0 and sends:
            part[name] = tensor.to("cpu", torch.float32, copy=True)
    if ps.tp_rank != 0 or ps.cp_rank != 0:
        return {}
    if ps.ep > 1 and ps.dp_rank // ps.ep == 0:  # the ep group of rank 0
        part = _gathered(part, ps.ep_group)
    if ps.pp > 1 and ps.dp_rank == 0:
        part = _gathered(part, ps.pp_group)
    return part if ps.is_main else {}


def _tp_whole(tensor: torch.Tensor, dim: int, ps: ParallelState) -> torch.Tensor:
    """The whole tensor of the tp ranks' blocks along dim (one all-gather)."""
    block = tensor.movedim(dim, 0).contiguous()
    whole = block.new_empty((ps.tp * block.shape[0], *block.shape[1:]))
    comm.all_gather_into(whole, block, ps.tp_group)
    return whole.movedim(0, dim)


def _gathered(part: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every rank's tensors of `group` (one all_gather_object)."""
    parts: list = [None] * comm.group_size(group)
    dist.all_gather_object(parts, part, group=group)
    return {name: tensor for piece in parts for name, tensor in piece.items()}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
