"""The policy's weights: where they start (checkpoint.init_from_hf, or the checkpoint
checkpoint.resume names)."""

from __future__ import annotations

from torch import nn

from megatronish.checkpoint.load import restore_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import Config, Derived
from megatronish.data_parallel import DataParallel
from megatronish.distributed.layout import ParallelState
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
