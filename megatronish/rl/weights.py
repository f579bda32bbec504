"""The policy's weights: where they start (checkpoint.init_from_hf, or the checkpoint
checkpoint.resume names), and the weights in Hugging Face names and shapes, streamed out to a
rollout engine and in from one, in memory.

Out (hf_weights): rl.stream's buckets, bitwise the export's tensors, one at a time on rank 0.
In (load_hf_weights): the family's mapping back (hf.importer.load_hf_tensors), each rank keeping
its blocks as a checkpoint load does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from megatronish.checkpoint.load import restore_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import Config, Derived
from megatronish.data_parallel import DataParallel
from megatronish.distributed.layout import ParallelState
from megatronish.hf.importer import load_hf_tensors
from megatronish.rl.stream import hf_buckets
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
    """(Hugging Face name, fp32 CPU tensor) of every weight, on rank 0, one bucket of about
    bucket_mb at a time (rl.stream); every rank iterates (the others get nothing) since the
    gathering is collective."""
    for bucket in hf_buckets(model, cfg, optimizer, bucket_mb):
        yield from bucket.items()


def load_hf_weights(
    model: nn.Module, optimizer: DataParallel, tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Loads (Hugging Face name, tensor) pairs, the whole model's, into model; every rank calls
    it with the same tensors. A missing, misshapen or unexpected tensor is a UserError."""
    with optimizer.whole_params(write_back=True):
        load_hf_tensors(model, tensors, "load_hf_weights")
