"""DPO's reference model in a run (train.objective dpo): the log-probabilities of each train
pair's responses under the initial weights, computed once before the first step and kept.

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
from megatronish.data.pairs import PairLoader
from megatronish.data_parallel import DataParallel
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.files import write_file
from megatronish.model.precision import autocast
from megatronish.objectives.batch import MicroBatch, micro_batches
from megatronish.objectives.dpo import DPO, METRICS
from megatronish.training.batches import batch_tensors
from megatronish.training.loss import batch_means
from megatronish.training.resume import checkpoint_dir, resume_path

if TYPE_CHECKING:
    from megatronish.pipeline.runner import Pipeline

REFERENCE_FILE = "dpo_reference.pt"


@torch.no_grad()
def reference_logps(
    model: torch.nn.Module,
    loader: PairLoader,
    objective: DPO,
    cfg: Config,
    ps: ParallelState,
    pipeline: Pipeline | None = None,
) -> torch.Tensor:
    """The table fp32 [P, 2] of every train pair's chosen and rejected log-probabilities under
    the model now, on every rank: each dp rank computes its share of each global batch's worth
    of pairs, then one all-reduce over dp (and one over pp from the last stage)."""
    table = torch.zeros(loader.source.meta["preference"]["pairs"], 2, dtype=torch.float64)
    table = table.to(ps.device)
    share = loader.global_batch_size // loader.dp_size
    in_precision = functools.partial(autocast, cfg, ps.device)
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
            logps = torch.cat([objective.logps[id(micro)] for micro in batch])  # [share, 2]
            kept = torch.from_numpy(valid).to(ps.device)
            table[torch.from_numpy(loader.pairs[samples[valid]]).to(ps.device)] = logps[
                kept
            ].double()
        objective.logps.clear()
    if ps.dp > 1:
        comm.all_reduce(table, ps.dp_group)
    if ps.pp > 1:
        comm.all_reduce(table, ps.pp_group)
    return table.float()


def with_reference(
    batch: list[MicroBatch], table: torch.Tensor, pairs: np.ndarray
) -> list[MicroBatch]:
    """The micro-batches of a step with their pairs' reference log-probabilities (pairs: the
    dataset's indices of this rank's pairs of the step, [accum x micro], in order)."""
    rows = table[torch.from_numpy(pairs).to(table.device)].reshape(len(batch), -1, 2)
    return [dataclasses.replace(micro, reference=rows[i]) for i, micro in enumerate(batch)]


def save_reference(directory: Path, table: torch.Tensor, dataset_sha256: str) -> None:
    """Writes the table into checkpoint.dir (whole, or not at all)."""
    buffer = io.BytesIO()
    torch.save({"dataset_sha256": dataset_sha256, "logps": table.cpu()}, buffer)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{REFERENCE_FILE}.tmp"
    try:
        write_file(partial, buffer.getvalue())
        os.replace(partial, directory / REFERENCE_FILE)
    finally:
        partial.unlink(missing_ok=True)


def load_reference(directory: Path, pairs: int, dataset_sha256: str) -> torch.Tensor:
    """The table a run saved in `directory` (its checkpoint.dir); UserError when it is missing
    or of another dataset."""
    path = directory / REFERENCE_FILE
    if not path.is_file():
        raise UserError(
            f"{path}: missing; a DPO run resumes with the reference log-probabilities its "
            "first start saved there (start over with checkpoint.resume=never)"
        )
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: whatever torch raises
        raise UserError(
            f"{path}: unreadable ({type(exc).__name__}); start over with checkpoint.resume=never"
        ) from None
    if (
        not isinstance(saved, dict)
        or saved.get("dataset_sha256") != dataset_sha256
        or saved["logps"].shape != (pairs, 2)
    ):
        raise UserError(
            f"{path}: the reference log-probabilities of another dataset; resume with the data "
            "the run started with, or start over with checkpoint.resume=never"
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
    """The run's reference table: on a fresh start computed from the model's initial weights,
    on a resume the one saved beside the checkpoint resumed from; rank 0 saves it into
    checkpoint.dir when the run saves checkpoints there and it is not there yet."""
    sha, pairs = loader.source.sha256, loader.source.meta["preference"]["pairs"]
    saved_in = None
    if resumed:
        path = resume_path(cfg)
        saved_in = path.parent if path is not None else checkpoint_dir(cfg)
        table = load_reference(saved_in, pairs, sha).to(ps.device)
    else:
        model.eval()
        table = reference_logps(model, loader, objective, cfg, ps, pipeline)
        data_parallel.after_eval()
        model.train()
    directory = checkpoint_dir(cfg)
    if cfg.checkpoint.save and ps.is_main and saved_in != directory:
        save_reference(directory, table, sha)
    return table


def step_metrics(objective, ps: ParallelState) -> dict[str, float]:
    """DPO's metrics (objectives.dpo.METRICS) since the last logged step, means over the global
    batches' pairs, on every rank (every rank calls it); none for another objective."""
    if not isinstance(objective, DPO):
        return {}
    values = batch_means(objective.take_metrics(), ps)
    return dict(zip(METRICS, values, strict=True))
