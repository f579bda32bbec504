"""What a run is built from before its loop starts: the config checked against the world size
and the dataset, the joined process groups, the data loaders, the autocast context."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatronish import ops
from megatronish.config import (
    Config,
    Derived,
    check_dataset_vocab,
    check_output_paths,
    derive,
    world_size_of,
)
from megatronish.data import BatchLoader, dataset_vocab_size, read_metadata, resolve_dataset
from megatronish.distributed.layout import (
    ParallelState,
    default_device,
    init_distributed,
    world_size_from_env,
)
from megatronish.errors import UserError
from megatronish.observe.tensorboard import check_available as check_tensorboard


@dataclass
class Setup:
    """Everything a run is built from, before the loop starts."""

    cfg: Config
    derived: Derived
    ps: ParallelState
    dataset_dir: Path


def setup(cfg: Config) -> Setup:
    """Checks the config against the world size, the dataset and the output paths, then joins
    the process group. Every user error surfaces here, before any collective, so no rank waits
    on a failed one; every rank finds the same one, so only rank 0 prints it."""
    world = world_size_from_env()
    try:
        dataset_dir, derived = _checked(cfg, world)
    except UserError as exc:
        exc.rank0_prints = True
        raise
    ps = init_distributed(
        derived.tp, derived.dp, cfg.parallel.timeout_s, derived.pp, derived.cp, derived.ep
    )
    return Setup(cfg, derived, ps, dataset_dir)


def _checked(cfg: Config, world: int) -> tuple[Path, Derived]:
    """(dataset directory, derived sizes) of a config checked for a world of `world` ranks."""
    wanted = world_size_of(cfg)
    if world == 1 and wanted > 1:
        raise UserError(
            f"parallel.tp * parallel.cp * parallel.dp * parallel.pp = {wanted} needs {wanted} "
            "processes; start "
            f"them with `megatronish launch --config ...` or `torchrun --nproc-per-node {wanted} "
            "-m megatronish train --config ...`"
        )
    dataset_dir = resolve_dataset(cfg.data.path)
    data_vocab = dataset_vocab_size(dataset_dir)
    check_dataset_vocab(cfg, data_vocab, dataset_dir)
    if cfg.train.eval_every > 0 and read_metadata(dataset_dir)["val_docs"] == 0:
        raise UserError(
            f"train.eval_every: the dataset {dataset_dir} has no validation documents; prepare "
            "it with --val-fraction > 0 (and more than one document) or set train.eval_every=0"
        )
    derived = derive(cfg, world, vocab_size=data_vocab)
    ops.check_backend(cfg.kernels.backend, default_device())
    if cfg.observe.tensorboard:
        check_tensorboard()
    check_output_paths(cfg)
    return dataset_dir, derived


def make_loader(s: Setup, split: str) -> BatchLoader:
    t = s.cfg.train
    return BatchLoader(
        s.dataset_dir,
        split=split,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        dp_rank=s.ps.dp_rank,
        dp_size=s.ps.dp,
        seed=t.seed,
    )
