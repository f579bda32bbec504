"""What each rank writes in a checkpoint save (step 2 of checkpoint.save's protocol): its files
as tensors (its model shard and experts, its optimizer state, its RNG states), and one file
written, flushed to disk and checksummed."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors.torch import save as serialize

from megatronish.checkpoint.format import FORMAT, model_file, optim_file, rng_file, saved_tensors
from megatronish.checkpoint.integrity import checksum_text
from megatronish.distributed.layout import ParallelState
from megatronish.files import write_file
from megatronish.layers.roles import role


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """One shard file, flushed to disk; returns the CRC-32C of the bytes written. A write the
    system refuses is a RunFailure naming the file (files.write_file)."""
    cpu = {key: value.detach().to("cpu").contiguous() for key, value in tensors.items()}
    data = serialize(cpu, metadata={"format": "pt", "writer": FORMAT})
    write_file(path, data)
    return checksum_text(data)


def _part(tensor: torch.Tensor, index: int | None) -> torch.Tensor:
    """The stored tensor: the whole tensor, or expert `index` of a stacked one."""
    return tensor if index is None else tensor[index]


def optimizer_tensors(
    model, optimizer, include_replicated: bool, experts_only: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's optimizer state as '<name>.<kind>' tensors, by the names its StateSpec gives
    (AdamW: exp_avg, exp_avg_sq, step), moments then scalars, those its state holds (Muon's
    matrices: momentum_buffer; a stacked expert weight's state by each expert's name)."""
    out: dict[str, torch.Tensor] = {}
    states, spec = optimizer.states_to_save(), optimizer.optim.state
    for name, param, index in saved_tensors(model):
        state = states.get(param)
        if not state or (role(param).tp_split_dim is None and not include_replicated):
            continue
        if experts_only and index is None:
            continue
        for kind in (k for k in spec.moments if k in state):
            out[f"{name}.{kind}"] = _part(state[kind], index)
        for kind in (k for k in spec.scalars if k in state):
            scalar = torch.as_tensor(state[kind], dtype=torch.float32).reshape(())
            out[f"{name}.{kind}"] = scalar if index is None else scalar.clone()  # one per expert
    return out


def rng_tensors(model, ps: ParallelState) -> dict[str, torch.Tensor]:
    """This rank's default CPU (and CUDA) generator states and the model's tracker streams."""
    out = {"cpu": torch.get_rng_state()}
    if ps.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(ps.device)
    for name, state in model.tracker.get_states().items():
        out[f"tracker.{name}"] = state.cpu()
    return out


def whole_params(optimizer):
    """A context in which the model's parameters are whole for rank_files to read (ZeRO-1 and 2's
    gathers waited for, ZeRO-3's buckets gathered); every rank enters it."""
    return contextlib.nullcontext() if optimizer is None else optimizer.whole_params()


def rank_files(model, optimizer, ps: ParallelState) -> dict[str, dict[str, torch.Tensor]]:
    """The files this rank writes, each as its tensors (replicated ones only on tp rank 0).
    Rank 0 of the dp x cp group writes the model and its experts; ranks 1 .. ep - 1 of it (the
    other ep ranks, at expert-data-parallel rank 0) write their experts only."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    stage = ps.pp_rank if ps.pp > 1 else None
    if ps.edp_rank == 0:
        dense = ps.dp_cp_rank == 0
        files[model_file(ps.tp_rank, stage, ps.ep_rank)] = {
            name: _part(param, index)
            for name, param, index in saved_tensors(model)
            if (index is not None or dense)
            and (role(param).tp_split_dim is not None or ps.tp_rank == 0)
        }
    if optimizer is not None and (optimizer.zero or ps.edp_rank == 0):
        experts_only = not optimizer.zero and ps.dp_cp_rank != 0
        state = optimizer_tensors(model, optimizer, ps.tp_rank == 0, experts_only)
        if state:
            files[optim_file(ps.tp_rank, ps.dp_cp_rank, stage)] = state
    files[rng_file(ps.rank)] = rng_tensors(model, ps)
    return files
