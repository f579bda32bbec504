"""A checkpoint's model for inference: `build_model` at any tp degree (eval and generate),
`refit` (streamed weights loaded in memory), and `load_model`, the public one-process model
over the real vocabulary."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from megatronish.checkpoint.load import inference_config, restore_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import Config, derive
from megatronish.distributed.layout import ParallelState


def build_model(ckpt: Checkpoint, ps: ParallelState, cfg: Config | None = None):
    """A GPT holding the checkpoint's weights at ps's tp degree, in eval mode (in the autocast
    precision alone: no fp8 GEMMs). cfg defaults to the checkpoint's own config."""
    model = inference_model(cfg if cfg is not None else ckpt.config, ckpt.vocab_size, ps)
    restore_model(ckpt, model)
    return model


def inference_model(cfg: Config, vocab_size: int, ps: ParallelState):
    """The GPT of cfg's model for inference at ps's tp degree (inference_config), in eval mode,
    at its seeded init until weights are restored or refit into it."""
    from megatronish.model import GPT
    from megatronish.model.plan import model_plan

    cfg = inference_config(cfg, vocab_size, ps.tp)
    derived = derive(cfg, ps.tp, vocab_size=vocab_size)
    return GPT(cfg, derived, ps, model_plan(cfg, derived, ps, fp8=False)).eval()


def refit(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Loads streamed weights into an inference model at its own tp (a build_model GPT, every
    rank with the same tensors): the whole model's (Hugging Face name, tensor) pairs, as a
    trainer's megatronish.rl.Policy.hf_weights gives them, in memory."""
    from megatronish.hf.importer import load_hf_tensors

    load_hf_tensors(model, tensors, "refit")


class CheckpointModel(nn.Module):
    """A checkpoint's GPT at tp = 1 whose forward returns logits over the real vocabulary:
    tokens [b, s] int64 -> logits [b, s, vocab_size] (the padding columns sliced off)."""

    def __init__(self, gpt: nn.Module, vocab_size: int, step: int, path: str):
        super().__init__()
        self.gpt, self.vocab_size, self.step, self.path = gpt, vocab_size, step, path

    @property
    def config(self) -> Config:
        return self.gpt.cfg

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)[..., : self.vocab_size]


def load_model(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> CheckpointModel:
    """The model of a checkpoint (a step directory, or a checkpoint.dir whose newest complete
    checkpoint is taken), saved at any layout, in eval mode, in this one process (it must not
    be one rank of a larger initialized process group)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("load_model runs in one process; this one is a rank of a process group")
    ckpt = Checkpoint(path)
    ckpt.check_in_background()  # every file, while the model is built
    model = build_model(ckpt, ParallelState.single(device))
    ckpt.verify()
    return CheckpointModel(model, ckpt.vocab_size, ckpt.step, str(ckpt.dir))
