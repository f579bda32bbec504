"""What a training run does with checkpoints: where they go, when it saves, what it resumes
from (checkpoint.resume: auto | never | PATH) and starting from Hugging Face weights."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from megatronish.checkpoint.format import find_latest, resolve_step_dir, write_text_atomic
from megatronish.checkpoint.load import restore_model, restore_optimizer, restore_rng
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import save_checkpoint, tokenizer_of_dataset
from megatronish.config import Config
from megatronish.data import BatchLoader
from megatronish.optim.optimizer import Optimizer
from megatronish.training.setup import Setup


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


def start(s: Setup, model: nn.Module, optimizer: Optimizer, loader: BatchLoader) -> int | None:
    """Restores the model, optimizer, RNGs and loader position from the resume checkpoint and
    returns its step; None for a fresh start, whose weights come from
    checkpoint.init_from_hf when that is set."""
    cfg, ps = s.cfg, s.ps
    path = resume_path(cfg)
    if path is None:
        if cfg.checkpoint.init_from_hf:
            from megatronish.checkpoint.hf import init_from_hf

            init_from_hf(cfg.checkpoint.init_from_hf, model, cfg, s.derived)
            if ps.is_main:
                print(f"initialized from {cfg.checkpoint.init_from_hf}", flush=True)
        return None
    ckpt = Checkpoint(path)
    restore_model(ckpt, model)
    restore_optimizer(ckpt, optimizer, model)
    restore_rng(ckpt, model, ps)
    if ckpt.loader_state is not None:
        loader.load_state_dict(ckpt.loader_state)
    if ps.is_main:
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


def save(s: Setup, step: int, model: nn.Module, optimizer: Optimizer, loader: BatchLoader) -> Path:
    """Saves the run's state at optimizer step `step` (every rank calls this)."""
    return save_checkpoint(
        checkpoint_dir(s.cfg),
        step,
        cfg=s.cfg,
        derived=s.derived,
        ps=s.ps,
        model=model,
        optimizer=optimizer,
        loader_state=loader.state_dict(),
        tokenizer=tokenizer_of_dataset(s.dataset_dir),
        keep=s.cfg.checkpoint.keep,
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
