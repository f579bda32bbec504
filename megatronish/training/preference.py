"""DPO's reference model in a run (train.objective dpo): the log-probabilities of each train
and validation pair's responses under the initial weights, computed once before the first step
and kept; and the validation metrics against it (every validation pair, each eval).

Why once per pair rather than a frozen copy of the model: a copy holds a second set of weights
on every rank and runs a second forward every step, every epoch; the table holds two numbers a
pair and costs one forward pass over the pairs, once. It is exact because a pair is always the
same row (data.pairs: one row per pair, whatever the step, epoch or layout), computed in the
training precision, by the same objective's sums. The pass runs the model in eval mode (no
dropout), forward only, with the pipeline where there is one. The table is saved beside the
checkpoints (REFERENCE_FILE in checkpoint.dir), so a resumed run keeps the initial weights'
values; a resume without it is a UserError.

Shapes: P the dataset's pairs, G global batch (pairs), accum x micro this dp rank's share.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatronish.config import Config
from megatronish.data import BatchLoader
from megatronish.data.blend import BlendLoader, open_loader
from megatronish.data.pairs import PairLoader, check_objective_data
from megatronish.data.sources import DataPlan
from megatronish.data_parallel import DataParallel
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.files import write_file
from megatronish.model.precision import autocast
from megatronish.objectives.batch import MicroBatch, micro_batches
from megatronish.objectives.dpo import DPO, METRICS
from megatronish.objectives.interface import Objective
from megatronish.training.batches import batch_tensors, validation_loss
from megatronish.training.loss import batch_means
from megatronish.training.resume import checkpoint_dir, resume_path

if TYPE_CHECKING:
    from megatronish.pipeline.runner import Pipeline

REFERENCE_FILE = "dpo_reference.pt"
RESUME_FIX = (
    "a DPO run resumes with the reference log-probabilities its first start saved there, of "
    "the data it started with; else start over with checkpoint.resume=never"
)
EVAL_FIX = (
    "eval of a DPO checkpoint reads the validation pairs' reference log-probabilities its run "
    "saved there: evaluate it in its run's checkpoint.dir, on the run's data"
)


@torch.no_grad()
def pair_logps(
    model: torch.nn.Module,
    loaders: list[PairLoader],
    objective: DPO,
    cfg: Config,
    ps: ParallelState,
    pipeline: Pipeline | None = None,
) -> torch.Tensor:
    """fp64 [P, 2, 2]: the sums of every pair of the loaders' splits' chosen and rejected
    response log-probabilities under the model now, and their token counts ([..., 0] and
    [..., 1]; zeros for the other pairs), on every rank: each dp rank computes its share of
    each global batch's worth of pairs, then one all-reduce over dp (and one over pp from the
    last stage). The model's mode is the caller's."""
    table = torch.zeros(loaders[0].source.meta["preference"]["pairs"], 2, 2, dtype=torch.float64)
    table = table.to(ps.device)
    in_precision = functools.partial(autocast, cfg, ps.device)
    for loader in loaders:
        share = loader.global_batch_size // loader.dp_size
        for first in range(0, loader.n_samples, loader.global_batch_size):
            samples = first + loader.dp_rank * share + np.arange(share)
            valid = samples < loader.n_samples
            samples = np.where(valid, samples, 0)  # past the end: pair 0 again, not kept
            inputs, targets, documents, _ = batch_tensors(loader.rows(samples), 0, ps, True)
            batch = micro_batches(inputs, targets, None, documents)
            if pipeline is not None:
                pipeline.run(batch, objective, 1.0, in_precision, forward_only=True)
            else:
                for micro in batch:
                    with in_precision():
                        objective(model, micro)
            if ps.is_last_stage:
                logps = torch.cat([objective.logps[id(micro)] for micro in batch])  # [share,2,2]
                kept = torch.from_numpy(valid).to(ps.device)
                pairs = torch.from_numpy(loader.pairs[samples[valid]]).to(ps.device)
                table[pairs] = logps[kept].double()
            objective.logps.clear()
    if ps.dp > 1:
        comm.all_reduce(table, ps.dp_group)
    if ps.pp > 1:
        comm.all_reduce(table, ps.pp_group)
    return table


def validation_metrics(
    model: torch.nn.Module,
    loader: PairLoader,
    objective: DPO,
    reference: torch.Tensor,
    cfg: Config,
    ps: ParallelState,
    pipeline: Pipeline | None = None,
) -> dict[str, float]:
    """{"val_loss", and each of METRICS with a val_ prefix}: the DPO loss and rewards of the
    model now over every pair of the loader's split once (its mode is the caller's), against
    the reference table [P, 2]; the same on every rank and at every layout."""
    logps = pair_logps(model, [loader], objective, cfg, ps, pipeline)
    pairs = torch.from_numpy(loader.pairs).to(ps.device)
    sums, counts = logps[pairs].float().unbind(-1)  # [n, 2] each
    ratios = sums - reference[pairs].to(sums.device)
    values = [objective.pair_losses(ratios, counts).mean(), *objective.reward_stats(ratios)]
    names = ["val_loss", *(f"val_{name}" for name in METRICS)]
    return dict(zip(names, torch.stack(values).tolist(), strict=True))


def with_reference(
    batch: list[MicroBatch], table: torch.Tensor, pairs: np.ndarray
) -> list[MicroBatch]:
    """The micro-batches of a step with their pairs' reference log-probabilities (pairs: the
    dataset's indices of this rank's pairs of the step, [accum x micro], in order)."""
    rows = table[torch.from_numpy(pairs).to(table.device)].reshape(len(batch), -1, 2)
    return [dataclasses.replace(micro, reference=rows[i]) for i, micro in enumerate(batch)]


def validation(
    model: torch.nn.Module,
    loader: BatchLoader | BlendLoader,
    objective: Objective,
    reference: torch.Tensor | None,
    cfg: Config,
    ps: ParallelState,
    pipeline: Pipeline | None,
) -> dict[str, float]:
    """A run's validation metrics: {"val_loss"} of batches.validation_loss, or with a reference
    table (DPO) validation_metrics."""
    if reference is not None:
        assert isinstance(loader, PairLoader) and isinstance(objective, DPO)
        return validation_metrics(model, loader, objective, reference, cfg, ps, pipeline)
    return {"val_loss": validation_loss(model, loader, cfg, ps, pipeline)[0]}


def evaluate_pairs(
    model: torch.nn.Module, cfg: Config, data: DataPlan, ps: ParallelState, directory: Path
) -> dict[str, float]:
    """validation_metrics of `model` (a DPO run's, in eval mode, one process) and "pairs", the
    validation pairs counted, against the reference table its run saved in `directory` (its
    checkpoint.dir); UserError where the data or the table does not serve."""
    check_objective_data(cfg.train.objective, data, cfg.train.seq_len)
    loader = open_loader(cfg, data, "val")
    assert isinstance(loader, PairLoader)
    pairs, sha = loader.source.meta["preference"]["pairs"], loader.source.sha256
    table = load_reference(directory, pairs, sha, ["val"], EVAL_FIX).to(ps.device)
    metrics = validation_metrics(model, loader, DPO(cfg, ps), table, cfg, ps)
    return {**metrics, "pairs": len(loader.pairs)}


def save_reference(
    directory: Path, table: torch.Tensor, dataset_sha256: str, splits: list[str]
) -> None:
    """Writes the table of the pairs of `splits` into checkpoint.dir (whole, or not at all)."""
    buffer = io.BytesIO()
    saved = {"dataset_sha256": dataset_sha256, "logps": table.cpu(), "splits": splits}
    torch.save(saved, buffer)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{REFERENCE_FILE}.tmp"
    try:
        write_file(partial, buffer.getvalue())
        os.replace(partial, directory / REFERENCE_FILE)
    finally:
        partial.unlink(missing_ok=True)


def load_reference(
    directory: Path, pairs: int, dataset_sha256: str, splits: list[str], fix: str = RESUME_FIX
) -> torch.Tensor:
    """The table a run saved in `directory` (its checkpoint.dir); UserError, ending with `fix`,
    when it is missing, of another dataset, or without the pairs of one of `splits`."""
    path = directory / REFERENCE_FILE
    if not path.is_file():
        raise UserError(f"{path}: missing; {fix}")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: whatever torch raises
        raise UserError(f"{path}: unreadable ({type(exc).__name__}); {fix}") from None
    if (
        not isinstance(saved, dict)
        or saved.get("dataset_sha256") != dataset_sha256
        or saved["logps"].shape != (pairs, 2)
    ):
        raise UserError(f"{path}: the reference log-probabilities of another dataset; {fix}")
    missing = [split for split in splits if split not in saved.get("splits", ["train"])]
    if missing:
        raise UserError(
            f"{path}: holds no reference log-probabilities of the {missing[0]} pairs; {fix}"
        )
    return saved["logps"]


def reference_for(
    cfg: Config,
    ps: ParallelState,
    model: torch.nn.Module,
    loader: PairLoader,
    objective: DPO,
    pipeline: Pipeline | None,
    data_parallel: DataParallel,
    resumed: bool,
) -> torch.Tensor:
    """The run's reference table: on a fresh start computed from the model's initial weights
    for the train pairs and the validation pairs (where the dataset has some), on a resume the
    one saved beside the checkpoint resumed from; rank 0 saves it into checkpoint.dir when the
    run saves checkpoints there and it is not there yet."""
    sha, pairs = loader.source.sha256, loader.source.meta["preference"]["pairs"]
    val_loader = loader.of_split("val")
    splits = ["train"] + (["val"] if val_loader is not None else [])
    saved_in = None
    if resumed:
        path = resume_path(cfg)
        saved_in = path.parent if path is not None else checkpoint_dir(cfg)
        splits = splits if cfg.train.eval_every > 0 else ["train"]  # those it needs
        table = load_reference(saved_in, pairs, sha, splits).to(ps.device)
    else:
        model.eval()
        loaders = [loader] + ([val_loader] if val_loader is not None else [])
        table = pair_logps(model, loaders, objective, cfg, ps, pipeline)[..., 0].float()
        data_parallel.after_eval()
        model.train()
    directory = checkpoint_dir(cfg)
    if cfg.checkpoint.save and ps.is_main and saved_in != directory:
        save_reference(directory, table, sha, splits)
    return table


def step_metrics(objective, ps: ParallelState) -> dict[str, float]:
    """DPO's metrics (objectives.dpo.METRICS) since the last logged step, means over the global
    batches' pairs, on every rank (every rank calls it); none for another objective."""
    if not isinstance(objective, DPO):
        return {}
    values = batch_means(objective.take_metrics(), ps)
    return dict(zip(METRICS, values, strict=True))
