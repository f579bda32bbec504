"""What a run is built from before its loop starts: the config checked against the world size,
the dataset and the model of the checkpoint it resumes from, the joined process groups, the data
loaders, the autocast context."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megatronish import fp8, ops
from megatronish.config import (
    Config,
    Derived,
    check_dataset_vocab,
    check_output_paths,
    derive,
    layout_notes,
    world_size_of,
)
from megatronish.data import BatchLoader
from megatronish.data.blend import BlendLoader, open_loader
from megatronish.data.pairs import check_objective_data, is_preference
from megatronish.data.sources import DataPlan, run_data
from megatronish.distributed.layout import (
    ParallelState,
    default_device,
    init_distributed,
    world_size_from_env,
)
from megatronish.errors import UserError
from megatronish.files import write_text_atomic
from megatronish.observe.tensorboard import check_available as check_tensorboard
from megatronish.training.resume import check_resumed_model, check_start_tokenizer


@dataclass
class Setup:
    """Everything a run is built from, before the loop starts."""

    cfg: Config  # as its data settles it (data.sources.run_data)
    derived: Derived
    ps: ParallelState
    data: DataPlan  # every dataset of the run, opened, with its blend weight (run_data)

    @property
    def dataset_dir(self) -> Path:
        """The (first) dataset: a prepared directory or a Megatron prefix."""
        return self.data.sources[0].path


def setup(cfg: Config) -> Setup:
    """Checks the config against the world size, the dataset (and that it is of the tokenizer
    the starting weights come with), the output paths and the model of the checkpoint it
    resumes from (a model.* key it changes: one line naming it), then joins the process group.
    Every user error surfaces here, before any collective, so no rank waits on a failed one;
    every rank finds the same one, so only rank 0 prints it."""
    world = world_size_from_env()
    try:
        cfg, data, derived = _checked(cfg, world)
    except UserError as exc:
        exc.rank0_prints = True
        raise
    ps = init_distributed(
        derived.tp, derived.dp, cfg.parallel.timeout_s, derived.pp, derived.cp, derived.ep
    )
    return Setup(cfg, derived, ps, data)


def _checked(cfg: Config, world: int) -> tuple[Config, DataPlan, Derived]:
    """(the config as its data settles it, the datasets, derived sizes) of a config checked for
    a world of `world` ranks."""
    wanted = world_size_of(cfg)
    if world == 1 and wanted > 1:
        raise UserError(
            f"parallel.tp * parallel.cp * parallel.dp * parallel.pp = {wanted} needs {wanted} "
            "processes; start "
            f"them with `megatronish launch --config ...` or `torchrun --nproc-per-node {wanted} "
            "-m megatronish train --config ...`"
        )
    cfg, data = run_data(cfg)
    check_start_tokenizer(cfg, data.sources)
    check_objective_data(cfg.train.objective, data, cfg.train.seq_len)
    dataset_dir = data.sources[0].path
    data_vocab = data.vocab_size
    check_dataset_vocab(cfg, data_vocab, dataset_dir)
    if cfg.train.eval_every > 0 and data.docs_in("val") == 0:
        raise UserError(
            f"train.eval_every: the dataset {dataset_dir} has no validation documents; prepare "
            "it with --val-fraction > 0 (and more than one document), give a Megatron prefix "
            'a data.split such as "969,30,1", or set train.eval_every=0'
        )
    derived = derive(cfg, world, vocab_size=data_vocab)
    ops.check_backend(cfg.kernels.backend, default_device())
    notes = (
        [fp8.check_device(default_device(), cfg.kernels.backend)]
        if cfg.train.precision == "fp8"
        else []
    )
    if cfg.observe.tensorboard:
        check_tensorboard()
    check_output_paths(cfg)
    changed = check_resumed_model(cfg, derived.vocab_size)
    if os.environ.get("RANK", "0") == "0":  # torchrun's global rank: said once
        for line in changed + layout_notes(cfg, derived):
            print(line, flush=True)
        for line in notes:
            print(line, file=sys.stderr, flush=True)
    return cfg, data, derived


def make_loader(setup: Setup, split: str) -> BatchLoader | BlendLoader:
    """The loader of `split` for this rank (the run reports the train split's datasets once it
    starts: write_data_report)."""
    return open_loader(setup.cfg, setup.data, split, setup.ps.dp_rank, setup.ps.dp)


def write_data_report(
    out_dir: str, loader: BatchLoader | BlendLoader, data: DataPlan, total: int
) -> None:
    """<out_dir>/data.json: {"datasets": [{"path", "weight", "samples"}]}, the samples each
    dataset gives to the run's total (train.steps x train.global_batch_size), and one printed
    line per dataset."""
    samples, weights = [0] * len(data.sources), [0.0] * len(data.sources)
    if isinstance(loader, BlendLoader):  # the datasets with documents in the split, reweighted
        counts = loader.counts_before(total)
        for index, weight, count in zip(loader.chosen, loader.weights, counts, strict=True):
            samples[index], weights[index] = int(count), weight
    else:
        samples[0], weights[0] = total, 1.0
    rows = [
        {"path": str(source.path), "weight": weight, "samples": count}
        for source, weight, count in zip(data.sources, weights, samples, strict=True)
    ]
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path / "data.json", json.dumps({"datasets": rows}, indent=2) + "\n")
    for row in rows:
        print(
            f"data: {row['path']} weight {row['weight']:.4g}, {row['samples']:,} of the run's "
            f"{total:,} samples",
            flush=True,
        )
    if data.sft:
        pairs = is_preference(data.sources[0])
        what = "preference pairs (one a sequence)" if pairs else "SFT examples"
        print(f"data: {what}, packed with document masks (each sees only itself)", flush=True)
