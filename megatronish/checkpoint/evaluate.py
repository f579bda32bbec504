"""`megatronish eval`: validation loss and perplexity of a checkpoint, in one process at tp 1.

The loss is computed as the trainer's evaluation computes it: the mean over the micro-batches
of the first train.eval_steps global batches of the validation split, so at the run's data and
batch settings it equals the val_loss the run logged at that step.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from megatronish.checkpoint.format import CONFIG_FILE
from megatronish.checkpoint.load import build_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import load_config
from megatronish.context import documents_of
from megatronish.distributed.layout import ParallelState, default_device
from megatronish.errors import UserError


@torch.no_grad()
def evaluate_checkpoint(
    checkpoint: str | os.PathLike[str], overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    """{"checkpoint", "step", "dataset", "val_loss", "perplexity", "tokens"} of the checkpoint on
    the validation split of its data.path (or the overrides', e.g. data.path=DIR)."""
    from megatronish.data import BatchLoader, dataset_vocab_size, resolve_dataset
    from megatronish.model.precision import autocast

    ckpt = Checkpoint(checkpoint)
    cfg = load_config(ckpt.dir / CONFIG_FILE, overrides)
    dataset_dir = resolve_dataset(cfg.data.path)
    data_vocab = dataset_vocab_size(dataset_dir)
    if data_vocab > ckpt.vocab_size:
        raise UserError(
            f"data.path: the dataset {dataset_dir} has {data_vocab} token ids, more than the "
            f"checkpoint's vocabulary ({ckpt.vocab_size})"
        )
    ps = ParallelState.single(default_device())
    ckpt.check_in_background()  # every file, while the model is built
    model = build_model(ckpt, ps, cfg)
    ckpt.verify()
    t = cfg.train
    loader = BatchLoader(
        dataset_dir, split="val", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, dp_rank=0, dp_size=1, seed=t.seed,
    )  # fmt: skip
    total = torch.zeros((), device=ps.device)
    count = tokens = 0
    for _ in range(t.eval_steps):
        for micro in loader.next_step().to(ps.device):
            inputs = micro[:, :-1]
            documents = documents_of(inputs, loader.eod_id) if cfg.data.document_mask else None
            with autocast(cfg, ps.device):
                total += model.loss(inputs, micro[:, 1:], documents).float()
            count += 1
            tokens += micro[:, 1:].numel()
    val_loss = float(total / count)
    return {
        "checkpoint": str(ckpt.dir),
        "step": ckpt.step,
        "dataset": str(dataset_dir),
        "val_loss": val_loss,
        "perplexity": math.exp(min(val_loss, 700.0)),
        "tokens": tokens,
    }
