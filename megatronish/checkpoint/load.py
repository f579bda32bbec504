"""Loading a checkpoint into a model (at any tp), an optimizer (any dp, ZeRO or not) and the
RNGs; the config a checkpoint's model runs with for inference."""

from __future__ import annotations

import copy

import torch
from torch import nn

from megatronish.checkpoint.format import all_stage_specs, model_specs
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import Config
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.layers.lora import is_adapter
from megatronish.moe.experts import is_expert, stored_tensors


@torch.no_grad()
def restore_model(source, model: nn.Module, part: str = "all") -> None:
    """Copies every parameter's block for this rank (model.derived.tp, model.ps.tp_rank) from a
    Checkpoint or FullTensors, after checking that the saved shapes fit the model (the whole
    model: every rank of a pipeline checks every stage's parameters). part: all, base (the
    source is a base model: the LoRA adapters, layers.lora, left as they are) or adapters (the
    source holds the adapters alone)."""

    def wanted_here(name: str) -> bool:
        return part == "all" or is_adapter(name) == (part == "adapters")

    specs = all_stage_specs(model, model.ps)
    source.check_compatible({n: s for n, s in specs.items() if wanted_here(n)})
    wanted = model_specs(model)
    tp, tp_rank = model.derived.tp, model.ps.tp_rank
    for name, param, index in stored_tensors(model.named_parameters()):
        if not wanted_here(name):
            continue
        target = param if index is None else param[index]
        target.copy_(source.block(name, "param", wanted[name], tp, tp_rank))


def restore_optimizer(ckpt: Checkpoint, optimizer, model: nn.Module) -> None:
    """Loads the optimizer state (by the names of its optim.state) of the parameters this
    rank's optimizer holds (under ZeRO only the owned ones), re-sharded for the model's tp
    rank. Parameters without saved state start fresh; a checkpoint without optimizer state
    (e.g. imported) leaves the optimizer as is."""
    if ckpt.meta.get("optimizer") is None:
        return
    wanted = model_specs(model)
    stored: dict[int, list[str]] = {}  # parameter -> its stored names (one per expert)
    for name, param, _ in stored_tensors(model.named_parameters()):
        stored.setdefault(id(param), []).append(name)
    tp, tp_rank = model.derived.tp, model.ps.tp_rank
    spec = optimizer.optim.state

    def read(param: nn.Parameter) -> dict[str, torch.Tensor] | None:
        names = stored[id(param)]
        if not all(ckpt.has_optimizer_state(name) for name in names):
            return None

        def moment(kind: str) -> torch.Tensor:
            blocks = [ckpt.block(n, kind, wanted[n], tp, tp_rank) for n in names]
            tensor = torch.stack(blocks) if is_expert(param) else blocks[0]
            return tensor.to(device=param.device, dtype=param.dtype)

        def scalar(kind: str) -> torch.Tensor:
            return ckpt.scalar(names[0], kind).to(param.device, torch.float32, copy=True)

        kinds = ckpt.optimizer_kinds(names[0])
        return {
            **{kind: scalar(kind) for kind in spec.scalars if kind in kinds},
            **{kind: moment(kind) for kind in spec.moments if kind in kinds},
        }

    optimizer.load_states(read)


def takes_optimizer_state(ckpt: Checkpoint, cfg: Config) -> bool:
    """Whether a resume under cfg loads ckpt's optimizer state: not under
    checkpoint.reset_optimizer; a UserError where ckpt's optimizer is not optim.name."""
    saved = (ckpt.meta.get("optimizer") or {}).get("kind")
    if cfg.checkpoint.reset_optimizer or saved is None:
        return False
    if saved != cfg.optim.name:
        raise UserError(
            f"optim.name: {ckpt.dir} holds the {saved} optimizer's state and optim.name is "
            f"{cfg.optim.name}; valid: optim.name {saved}, or checkpoint.reset_optimizer: true "
            "(the weights resumed, the optimizer state fresh)",
            rank0_prints=True,
        )
    return True


def rng_states_for(
    ckpt: Checkpoint, tp: int, dp: int, rank: int, pp: int = 1, cp: int = 1
) -> dict[str, torch.Tensor] | None:
    """Global rank `rank`'s RNG states for a run at (tp, dp, pp, cp). At the saved layout, its
    own saved states (an exact resume). At another layout, the default streams of saved rank 0
    (they are the same on every rank) and the tracker streams of the saved rank with the same
    tp rank at cp, dp and pp rank 0, if there is one (dropout inside tp regions draws other
    masks at another tp)."""
    if (tp, dp, pp, cp) == (ckpt.tp, ckpt.dp, ckpt.pp, ckpt.cp):
        return ckpt.rng_states(rank)
    base = ckpt.rng_states(0)
    if base is None:
        return None
    states = {k: v for k, v in base.items() if not k.startswith("tracker.")}
    tp_rank = rank % tp
    same_tp_rank = ckpt.rng_states(tp_rank) if tp_rank < ckpt.tp else None
    if same_tp_rank is not None:
        states.update({k: v for k, v in same_tp_rank.items() if k.startswith("tracker.")})
    return states


def restore_rng(ckpt: Checkpoint, model: nn.Module, ps: ParallelState) -> None:
    """Sets this rank's CPU (and CUDA) generator and the model's tracker from the checkpoint;
    states saved on another device type are skipped (their sizes differ)."""
    states = rng_states_for(ckpt, ps.tp, ps.dp, ps.rank, ps.pp, ps.cp)
    if states is None:
        return
    saved_on_cuda = "cuda" in states
    torch.set_rng_state(states["cpu"])
    if ps.device.type == "cuda" and saved_on_cuda:
        torch.cuda.set_rng_state(states["cuda"], ps.device)
    tracker = {k.removeprefix("tracker."): v for k, v in states.items() if k.startswith("tracker.")}
    if tracker and saved_on_cuda == (ps.device.type == "cuda"):
        model.tracker.set_states(tracker)


def single_layout_config(cfg: Config, tp: int) -> Config:
    """A copy of a checkpoint's config at tp ranks alone: dp, pp, cp and ep 1."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.pp_layers = tp, None, 1, None
    cfg.parallel.cp = cfg.parallel.ep = 1
    return cfg


def inference_config(cfg: Config, vocab_size: int, tp: int) -> Config:
    """A copy of a checkpoint's config for inference at tp ranks alone (single_layout_config):
    no sequence parallelism or decomposed tp communication (decoding runs any length), no
    activation checkpointing, the saved vocab size."""
    cfg = single_layout_config(cfg, tp)
    cfg.parallel.sequence_parallel = False
    cfg.parallel.tp_comm_overlap = False
    cfg.train.activation_checkpointing = "none"
    cfg.model.vocab_size = vocab_size
    return cfg
