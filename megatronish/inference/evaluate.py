"""`megatronish eval`: validation loss and perplexity of a checkpoint, in one process at tp 1.

The loss is the one the run's evaluation computes (training.batches.validation_loss) over the
first train.eval_steps global batches of the validation split, so at the run's data and batch
settings it equals the val_loss the run logged at that step.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from megatronish.checkpoint.format import CONFIG_FILE
from megatronish.checkpoint.model_match import model_differences, refuse_other_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import tokenizer_identity, tokenizer_of_checkpoint
from megatronish.config import load_config
from megatronish.distributed.layout import ParallelState, default_device
from megatronish.errors import UserError
from megatronish.inference.model import build_model

if TYPE_CHECKING:
    from megatronish.data.sources import DataPlan


def evaluate_checkpoint(
    checkpoint: str | os.PathLike[str], overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    """{"checkpoint", "step", "dataset", "val_loss", "perplexity", "tokens"} of the checkpoint on
    the validation split of its data.path or data.blend (or the overrides', e.g.
    data.path=DIR): a prepared directory, a Megatron prefix or a blend of them. With a loss mask
    (SFT data, data.eod_mask_loss) val_loss is the mean over the counted tokens, and "tokens"
    counts those. On the preference pairs of a DPO run (train.objective dpo), the DPO loss and
    rewards of every validation pair (training.preference.evaluate_pairs) and "pairs" instead
    of perplexity and tokens. An override that changes a model.* key (but
    model_match.MAY_DIFFER) is a UserError naming it: the model is the one the checkpoint was
    trained with."""
    from megatronish.data.blend import open_loader
    from megatronish.data.pairs import is_preference
    from megatronish.data.sources import check_trained_tokenizer, run_data
    from megatronish.training.batches import validation_loss
    from megatronish.training.loss import counted_targets
    from megatronish.training.preference import evaluate_pairs

    ckpt = Checkpoint(checkpoint)
    cfg = load_config(ckpt.dir / CONFIG_FILE, (*_other_data(overrides), *overrides))
    vocab_size = cfg.model.vocab_size if cfg.model.vocab_size is not None else ckpt.vocab_size
    refuse_other_model(
        model_differences(ckpt.config, ckpt.vocab_size, cfg, vocab_size),
        ckpt.dir,
        "--set asks for",
        "drop --set {key}={wanted}: eval runs the model the checkpoint was trained with",
    )
    cfg, data = run_data(cfg, vocab_size)  # SFT data: document masks, as in training
    check_trained_tokenizer(
        cfg,
        data.sources,
        tokenizer_identity(tokenizer_of_checkpoint(ckpt.dir, ckpt.meta)),
        f"the checkpoint {ckpt.dir} was trained on tokenizer",
        "evaluate it on data of that tokenizer",
    )
    dataset = ", ".join(str(source.path) for source in data.sources)
    preference = any(is_preference(source) for source in data.sources)
    _refuse_data(dataset, preference and cfg.train.objective != "dpo", data, ckpt.vocab_size)
    ps = ParallelState.single(default_device())
    ckpt.check_in_background()  # every file, while the model is built
    model = build_model(ckpt, ps, cfg)
    ckpt.verify()
    named = {"checkpoint": str(ckpt.dir), "step": ckpt.step, "dataset": dataset}
    if preference:  # the pairs against the reference the run saved in its checkpoint.dir
        return named | evaluate_pairs(model, cfg, data, ps, ckpt.dir.parent)
    val_loss, targets = validation_loss(model, open_loader(cfg, data, "val"), cfg, ps)
    return {
        **named,
        "val_loss": val_loss,
        "perplexity": math.exp(min(val_loss, 700.0)),
        "tokens": int(counted_targets(targets)),
    }


def _refuse_data(dataset: str, foreign_pairs: bool, data: DataPlan, vocab_size: int) -> None:
    """UserError for preference pairs of a run other than DPO's (foreign_pairs), or data of more
    token ids than the checkpoint's vocabulary."""
    if foreign_pairs:
        raise UserError(
            f"data.path: {dataset} holds preference pairs, whose loss is a DPO run's; evaluate "
            "a checkpoint of train.objective dpo on them, or this one on text or SFT data "
            "(--set data.path=DIR)"
        )
    if data.vocab_size > vocab_size:
        raise UserError(
            f"data.path: the dataset {dataset} has {data.vocab_size} token ids, more than the "
            f"checkpoint's vocabulary ({vocab_size})"
        )


def _other_data(overrides: tuple[str, ...]) -> tuple[str, ...]:
    """An override of data.path replaces the run's data.blend, and one of data.blend its
    data.path: eval on another dataset never meets both."""
    named = {override.split("=", 1)[0].strip() for override in overrides}
    if "data.path" in named and "data.blend" not in named:
        return ("data.blend=null",)
    if "data.blend" in named and "data.path" not in named:
        return ("data.path=null",)
    return ()
