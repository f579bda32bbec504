"""The global batch as the step loop reads it (`next_batch`), and the validation loss read the
same way (`validation_loss`): the run's evaluation and `megatronish eval` both compute it here,
so eval of a checkpoint at the run's data and batch settings gives the val_loss the run logged.

Shapes: accum micro-batches of micro sequences per rank and global batch, s the sequence length
(s / cp on a cp rank: its zigzag shard).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from megatronish.config import Config
from megatronish.context import Documents, documents_at, documents_of, split_batch
from megatronish.data import BatchLoader
from megatronish.data.loader import StepBatch
from megatronish.distributed.layout import ParallelState
from megatronish.model.mtp import future_tokens_of, shard_future_tokens
from megatronish.model.precision import autocast
from megatronish.objectives.batch import micro_batches
from megatronish.objectives.registry import objective_for
from megatronish.training.loss import counted_share, mean_loss

if TYPE_CHECKING:
    from megatronish.data.blend import BlendLoader
    from megatronish.pipeline.runner import Pipeline


def next_batch(
    loader: BatchLoader | BlendLoader, ps: ParallelState, document_mask: bool, mtp_depth: int = 0
) -> tuple[torch.Tensor, torch.Tensor, Documents | None, torch.Tensor | None]:
    """The next global batch's inputs and targets for this rank, [accum, micro, s / cp] each:
    the loader's samples of this dp rank, this cp rank's zigzag shard of them (targets that do
    not count in the loss are -100); with document_mask (data.document_mask) their documents
    (the dataset's records where the loader gives their starts, else found at the end-of-text
    tokens of the whole sequences; then split like them); with mtp_depth D > 0 the tokens and
    targets ahead (model.mtp.future_tokens_of of the whole sequences, then split like them)
    [accum, micro, 2, D, s / cp], else None."""
    return batch_tensors(loader.next_step_batch(), loader.eod_id, ps, document_mask, mtp_depth)


def batch_tensors(
    step: StepBatch, eod_id: int, ps: ParallelState, document_mask: bool, mtp_depth: int = 0
) -> tuple[torch.Tensor, torch.Tensor, Documents | None, torch.Tensor | None]:
    """next_batch's tensors of a loader's step (documents end after eod_id where the step does
    not give their starts)."""
    batch, loss_mask = step.tokens.to(ps.device), step.loss_mask  # [accum, micro, s + 1], [..., s]
    documents = future_tokens = None
    if document_mask and step.starts is not None:  # the dataset's records
        documents = documents_at(step.starts.to(ps.device)).shard(ps.cp, ps.cp_rank)
    elif document_mask:
        documents = documents_of(batch[..., :-1], eod_id).shard(ps.cp, ps.cp_rank)
    if mtp_depth > 0:
        whole = split_batch(batch, 1, 0, loss_mask)
        whole_future = future_tokens_of(*whole, mtp_depth)
        future_tokens = shard_future_tokens(whole_future, ps.cp, ps.cp_rank)
    return *split_batch(batch, ps.cp, ps.cp_rank, loss_mask), documents, future_tokens


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    loader: BatchLoader | BlendLoader,
    cfg: Config,
    ps: ParallelState,
    pipeline: Pipeline | None = None,
) -> tuple[float, torch.Tensor]:
    """(the mean loss over the next train.eval_steps global batches of `loader`, the targets
    evaluated [eval_steps x accum, micro, s / cp]). The mean is of the micro-batch means, or
    with a loss mask of every counted target of the dp x cp group (loss.py), on every rank;
    documents are masked as cfg's data.document_mask says. Runs the pipeline when given one,
    else the model on this rank's micro-batches; the model's mode is the caller's."""
    divisor = torch.ones((), device=ps.device) if loader.masks_loss else None
    in_precision = functools.partial(autocast, cfg, ps.device)
    objective = objective_for(cfg, ps)
    total = torch.zeros((), device=ps.device)
    seen, count = [], 0  # the targets, and the micro-batches, evaluated
    for _ in range(cfg.train.eval_steps):
        inputs, targets, documents, _ = next_batch(loader, ps, cfg.data.document_mask)
        batch = micro_batches(inputs, targets, divisor, documents)
        if pipeline is not None:
            total += pipeline.run(batch, objective, 1.0, in_precision, forward_only=True)
        else:
            for micro in batch:
                with in_precision():
                    loss = objective(model, micro).main  # the main loss alone
                total += loss.float()
        seen.append(targets)
        count += inputs.shape[0]
    evaluated = torch.cat(seen)
    if divisor is not None and ps.is_last_stage:
        return mean_loss(total / counted_share(evaluated, ps), ps), evaluated
    return mean_loss(total / count, ps), evaluated
