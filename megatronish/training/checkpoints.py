"""What a training run does with checkpoints: where they go, when it saves, what it resumes
from (checkpoint.resume: auto | never | PATH) and starting from Hugging Face weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from megatronish.checkpoint.format import find_latest, resolve_step_dir, write_text_atomic
from megatronish.checkpoint.load import restore_model, restore_optimizer, restore_rng
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import save_checkpoint, tokenizer_of_dataset
from megatronish.config import Config

if TYPE_CHECKING:
    from megatronish.training.trainer import Trainer


def checkpoint_dir(cfg: Config) -> Path:
    """checkpoint.dir, or <run.out_dir>/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.out_dir) / "checkpoints"


def resume_path(cfg: Config) -> Path | None:
    """The step directory to resume from: never -> None; auto -> the newest complete one in
    checkpoint.dir (None when there is none); a path -> that checkpoint (UserError if missing)."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        return find_latest(checkpoint_dir(cfg))
    return resolve_step_dir(mode)


def start(trainer: Trainer) -> int | None:
    """Restores the trainer's model, optimizer, RNGs, loader position and step from the resume
    checkpoint and returns its step; None for a fresh start, whose weights come from
    checkpoint.init_from_hf when that is set."""
    cfg = trainer.cfg
    path = resume_path(cfg)
    if path is None:
        if cfg.checkpoint.init_from_hf:
            from megatronish.checkpoint.hf import init_from_hf

            init_from_hf(cfg.checkpoint.init_from_hf, trainer.model, cfg, trainer.setup.derived)
            if trainer.ps.is_main:
                print(f"initialized from {cfg.checkpoint.init_from_hf}", flush=True)
        return None
    ckpt = Checkpoint(path)
    restore_model(ckpt, trainer.model)
    restore_optimizer(ckpt, trainer.optimizer, trainer.model)
    restore_rng(ckpt, trainer.model, trainer.ps)
    if ckpt.loader_state is not None:
        trainer.loader.load_state_dict(ckpt.loader_state)
    trainer.step = ckpt.step
    if trainer.ps.is_main:
        print(f"resumed from {ckpt.dir} at step {ckpt.step}", flush=True)
        if ckpt.step >= cfg.train.steps:
            print(
                f"nothing to train: the checkpoint is at step {ckpt.step} and train.steps is "
                f"{cfg.train.steps} (raise train.steps, or start over with "
                "checkpoint.resume=never)",
                flush=True,
            )
    return ckpt.step


def due(step: int, cfg: Config) -> bool:
    """Whether the run saves after optimizer step `step` (besides the save at its end)."""
    every = cfg.checkpoint.every
    return cfg.checkpoint.save and every > 0 and step % every == 0


def save(trainer: Trainer) -> Path:
    """Saves the trainer's state at its current step (every rank calls this)."""
    s = trainer.setup
    return save_checkpoint(
        checkpoint_dir(trainer.cfg),
        trainer.step,
        cfg=trainer.cfg,
        derived=s.derived,
        ps=trainer.ps,
        model=trainer.model,
        optimizer=trainer.optimizer,
        loader_state=trainer.loader.state_dict(),
        tokenizer=tokenizer_of_dataset(s.dataset_dir),
        keep=trainer.cfg.checkpoint.keep,
    )


def trim_metrics(out_dir: Path, step: int) -> None:
    """Drops the lines of metrics.jsonl after `step` (written by a run killed after its last
    checkpoint) and any partial last line, so the resumed run appends the curve seamlessly."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))
