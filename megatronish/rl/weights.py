"""The policy's weights: where they start (checkpoint.init_from_hf, or the checkpoint
checkpoint.resume names), and the weights in Hugging Face names and shapes, streamed out to a
rollout engine and in from one, in memory.

Out (hf_weights): each stored tensor made whole over tp (an all-gather along its split dim,
vocab padding dropped) and, under ZeRO-3, over dp (the level's whole_params); the stages' and
ep ranks' tensors then reach rank 0 (all_gather_object over the ep group, then the pp group,
in rounds of about bucket_mb each), which maps them as `megatronish export` does
(hf.exporter.hf_tensors): bitwise the export's tensors. In (load_hf_weights): the family's
mapping back (hf.importer.load_hf_tensors), each rank keeping its blocks as a checkpoint load does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megatronish.checkpoint.format import saved_tensors
from megatronish.checkpoint.load import restore_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import Config, Derived
from megatronish.data_parallel import DataParallel
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.hf.exporter import hf_tensors
from megatronish.hf.importer import load_hf_tensors, one_process
from megatronish.layers.roles import role
from megatronish.training.resume import resume_path


def load_start(
    cfg: Config, derived: Derived, ps: ParallelState, model: nn.Module, optimizer: DataParallel
) -> None:
    """Loads the starting weights into model (every rank calls it): checkpoint.init_from_hf's
    when set, else those of the checkpoint checkpoint.resume names (auto: the newest in
    checkpoint.dir, if any); nothing else keeps the seeded init. The optimizer state starts
    fresh."""
    if cfg.checkpoint.init_from_hf:
        from megatronish.hf.importer import init_from_hf

        with optimizer.whole_params(write_back=True):
            init_from_hf(cfg.checkpoint.init_from_hf, model, cfg, derived, ps.is_main)
        return
    path = resume_path(cfg)
    if path is not None:
        with optimizer.whole_params(write_back=True):
            restore_model(Checkpoint(path), model)


def hf_weights(
    model: nn.Module, cfg: Config, optimizer: DataParallel, bucket_mb: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, fp32 CPU tensor) of every weight, on rank 0; every rank iterates
    (the others get nothing) since the gathering is collective."""
    ps: ParallelState = model.ps
    ours = _whole_on_rank0(model, ps, optimizer, int(bucket_mb * 2**20))
    if not ps.is_main:
        return
    yield from hf_tensors(*one_process(cfg), ours).items()


def load_hf_weights(
    model: nn.Module, optimizer: DataParallel, tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Loads (Hugging Face name, tensor) pairs, the whole model's, into model; every rank calls
    it with the same tensors. A missing, misshapen or unexpected tensor is a UserError."""
    with optimizer.whole_params(write_back=True):
        load_hf_tensors(model, tensors, "load_hf_weights")


@torch.no_grad()
def _whole_on_rank0(
    model: nn.Module, ps: ParallelState, optimizer: DataParallel, bucket_bytes: int
) -> dict[str, torch.Tensor]:
    """Our whole, unpadded tensors by checkpoint name on rank 0 ({} elsewhere)."""
    local: dict[str, torch.Tensor] = {}
    with optimizer.whole_params():
        for name, param, index in saved_tensors(model):
            tensor = param.detach() if index is None else param.detach()[index]
            spec = role(param)
            if spec.tp_split_dim is not None and ps.tp > 1:
                tensor = _tp_whole(tensor, spec.tp_split_dim, ps)
            if spec.valid_rows is not None:
                tensor = tensor[: spec.valid_rows]
            if ps.tp_rank == 0 and ps.cp_rank == 0:
                local[name] = tensor.to("cpu", torch.float32, copy=True)
    if ps.tp_rank != 0 or ps.cp_rank != 0:
        return {}
    if ps.ep > 1 and ps.dp_rank // ps.ep == 0:  # the ep group of rank 0
        local = _gathered(local, ps.ep_group, bucket_bytes, ps.device)
    if ps.pp > 1 and ps.dp_rank == 0:
        local = _gathered(local, ps.pp_group, bucket_bytes, ps.device)
    return local if ps.is_main else {}


def _tp_whole(tensor: torch.Tensor, dim: int, ps: ParallelState) -> torch.Tensor:
    """The whole tensor of the tp ranks' blocks along dim (one all-gather)."""
    block = tensor.movedim(dim, 0).contiguous()
    whole = block.new_empty((ps.tp * block.shape[0], *block.shape[1:]))
    comm.all_gather_into(whole, block, ps.tp_group)
    return whole.movedim(0, dim)


def _gathered(
    local: dict[str, torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int, device
) -> dict[str, torch.Tensor]:
    """Every rank's tensors of `group`, in rounds of about bucket_bytes a rank."""
    buckets: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in local.items():
        if buckets[-1] and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += tensor.numel() * tensor.element_size()
    rounds = torch.tensor([len(buckets)], device=device)
    comm.all_reduce(rounds, group, op=dist.ReduceOp.MAX)
    out: dict[str, torch.Tensor] = {}
    for index in range(int(rounds.item())):
        parts: list = [None] * comm.group_size(group)
        dist.all_gather_object(parts, buckets[index] if index < len(buckets) else {}, group=group)
        for part in parts:
            out.update(part)
    return out
