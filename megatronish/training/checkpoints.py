"""What a training run does with checkpoints: when it saves (Saver: at once, or in the
background with checkpoint.async), restoring the one it resumes from (the resume module says
which) and starting from Hugging Face weights."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from torch import nn
from tqdm import tqdm

from megatronish.checkpoint.async_save import AsyncSaver
from megatronish.checkpoint.format import complete_steps, find_latest
from megatronish.checkpoint.integrity import CorruptCheckpoint, first_message_of_ranks
from megatronish.checkpoint.load import (
    restore_model,
    restore_optimizer,
    restore_rng,
    takes_optimizer_state,
)
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import save_checkpoint, tokenizer_of_dataset
from megatronish.config import Config
from megatronish.data import BatchLoader
from megatronish.data_parallel import DataParallel
from megatronish.distributed.comm import any_rank
from megatronish.errors import Interrupted, UserError
from megatronish.files import free_space, size_text, write_text_atomic
from megatronish.training.faults import StepVerdict
from megatronish.training.resume import auto_choice, checkpoint_dir, resume_path
from megatronish.training.setup import Setup


def lock_before_building(setup: Setup) -> bool:
    """Whether the run locks checkpoint.dir before it builds and restores: when it saves and
    checkpoint.dir exists (on any rank; one all-reduce), since it may resume from there. A new
    checkpoint.dir is locked, and so created, only once the run is built, so that a run that
    fails to start leaves nothing behind."""
    exists = setup.cfg.checkpoint.save and checkpoint_dir(setup.cfg).is_dir()
    return setup.cfg.checkpoint.save and any_rank(exists, setup.ps.device)


def start(
    setup: Setup, model: nn.Module, optimizer: DataParallel, loader: BatchLoader
) -> int | None:
    """Restores the model, optimizer, RNGs and loader position from the resume checkpoint and
    returns its step; None for a fresh start, whose weights come from
    checkpoint.init_from_hf when that is set."""
    cfg, ps = setup.cfg, setup.ps
    path = resume_path(cfg)
    choice = auto_choice(cfg, path)
    if choice is not None and ps.is_main:
        print(choice, flush=True)
    if ps.is_main and cfg.checkpoint.save:
        warn_if_short_of_space(checkpoint_dir(cfg), path or find_latest(checkpoint_dir(cfg)))
    if path is None:
        if cfg.checkpoint.init_from_hf:
            from megatronish.hf.importer import init_from_hf

            with optimizer.whole_params(write_back=True):
                init_from_hf(cfg.checkpoint.init_from_hf, model, cfg, setup.derived, ps.is_main)
            if ps.is_main:
                print(f"initialized from {cfg.checkpoint.init_from_hf}", flush=True)
        if cfg.checkpoint.init_lora_from:
            from megatronish.hf.peft import init_lora_from

            with optimizer.whole_params(write_back=True):
                init_lora_from(cfg.checkpoint.init_lora_from, model, cfg)
        return None
    ckpt = _restore(setup, path, model, optimizer)
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


def warn_if_short_of_space(directory: Path, last: Path | None) -> None:
    """Prints the one-line warning that `directory` (checkpoint.dir) has less free space than
    checkpoint `last` (the one resumed from, else the newest there; None: nothing to compare)
    takes on disk, so the run's next save will fail."""
    if last is None:
        return
    needed = sum(child.stat().st_size for child in last.iterdir() if child.is_file())
    where, free = free_space(directory)
    if free < needed:
        print(
            f"warning: checkpoint.dir {directory} has {size_text(free)} free, less than the "
            f"last checkpoint's {size_text(needed)} ({last.name}): the next save will fail; "
            f"free space on {where} or set checkpoint.dir to another disk",
            file=sys.stderr,
            flush=True,
        )


def _restore_optimizer(
    setup: Setup, ckpt: Checkpoint, model: nn.Module, optimizer: DataParallel
) -> None:
    """The checkpoint's optimizer state into optimizer, unless checkpoint.reset_optimizer (one
    line from rank 0 says it starts fresh); a UserError where the checkpoint's optimizer is
    not optim.name."""
    if takes_optimizer_state(ckpt, setup.cfg):
        restore_optimizer(ckpt, optimizer, model)
    elif setup.cfg.checkpoint.reset_optimizer and setup.ps.is_main:
        print(
            f"{ckpt.dir}: the weights resume, the {setup.cfg.optim.name} optimizer's state "
            "starts fresh (checkpoint.reset_optimizer)",
            flush=True,
        )


def _restore(setup: Setup, path: Path, model: nn.Module, optimizer: DataParallel) -> Checkpoint:
    """Restores model, optimizer and RNGs from `path`, each rank checking the files it reads
    and its share of the others; a corrupt file found by any rank stops every rank (before a
    step is trained), rank 0 printing the one line that names it (and, under
    checkpoint.resume=auto, the newest older checkpoint that is intact)."""
    ps, corrupt, ckpt = setup.ps, None, None
    try:
        ckpt = Checkpoint(path)
        ckpt.check_in_background(ckpt.share(ps.rank, ps.world_size))
        with optimizer.whole_params(write_back=True):
            restore_model(ckpt, model)
        _restore_optimizer(setup, ckpt, model, optimizer)
        restore_rng(ckpt, model, ps)
        ckpt.verify(ckpt.share(ps.rank, ps.world_size))
    except CorruptCheckpoint as exc:
        corrupt = str(exc)
    corrupt = first_message_of_ranks(corrupt, ps.world_size)
    if corrupt is None:
        return ckpt
    if setup.cfg.checkpoint.resume == "auto" and ps.is_main:
        older = newest_intact_before(path)
        advice = (
            f"resume from the newest intact checkpoint with --set checkpoint.resume={older}"
            if older is not None
            else "no older checkpoint is intact; start over with --set checkpoint.resume=never"
        )
        corrupt += f"; checkpoint.resume=auto took {path}, and nothing was trained on it: {advice}"
    raise UserError(corrupt, rank0_prints=True)


def aborted(cfg: Config, is_main: bool) -> Interrupted:
    """After a second Ctrl-C (every rank calls it): rank 0 removes the temporary directory of a
    save in progress, which its pid names (checkpoint.save.open_save), and the error says what
    the run can continue from."""
    directory = checkpoint_dir(cfg)
    if is_main and directory.is_dir():
        for unfinished in directory.glob(f"step_*.tmp-{os.getpid()}"):
            for _ in range(3):  # a writer may create one more file as it goes
                shutil.rmtree(unfinished, ignore_errors=True)
                if not unfinished.exists():
                    break
    latest = find_latest(directory)
    where = (
        f"the newest checkpoint is {latest}: run the same command again to continue from it"
        if latest is not None
        else "no checkpoint was saved"
    )
    return Interrupted(f"a second Ctrl-C stopped the run at once; {where}", rank0_prints=True)


def newest_intact_before(step_dir: Path) -> Path | None:
    """The newest complete checkpoint of step_dir's checkpoint.dir older than step_dir whose
    every file has its recorded checksum (or none recorded); None when there is none."""
    older = [p for p in complete_steps(step_dir.parent) if p.name < step_dir.name]
    for candidate in reversed(older):
        try:
            Checkpoint(candidate).verify()
        except UserError:
            continue
        return candidate
    return None


def due(step: int, cfg: Config) -> bool:
    """Whether the run saves after optimizer step `step` (besides the save at its end)."""
    every = cfg.checkpoint.every
    return cfg.checkpoint.save and every > 0 and step % every == 0


def save(
    setup: Setup, step: int, model: nn.Module, optimizer: DataParallel, loader: BatchLoader
) -> Path:
    """Saves the run's state at optimizer step `step` (every rank calls this)."""
    return save_checkpoint(
        checkpoint_dir(setup.cfg), step, **_save_args(setup, model, optimizer, loader)
    )


def _save_args(
    setup: Setup, model: nn.Module, optimizer: DataParallel, loader: BatchLoader
) -> dict:
    """save_checkpoint's keyword arguments for the run's state now."""
    return dict(
        cfg=setup.cfg,
        derived=setup.derived,
        ps=setup.ps,
        model=model,
        optimizer=optimizer,
        loader_state=loader.state_dict(),
        tokenizer=tokenizer_of_dataset(setup.data.tokenizer_source.path),
        keep=setup.cfg.checkpoint.keep,
    )


class Saver:
    """The run's saves, every rank calling each method at the same point of the run. Without
    checkpoint.async a save is done when save() returns; with it, save() returns once the state
    is copied, and the save completes (complete on disk on every rank, renamed into place,
    "saved" printed by rank 0) at the first step boundary where every rank's writer is done
    (poll), at the next save, or at finish()."""

    def __init__(self, setup: Setup):
        self.setup = setup
        wanted = setup.cfg.checkpoint.async_ and setup.cfg.checkpoint.save
        self.background = AsyncSaver() if wanted else None

    @property
    def writing(self) -> bool:
        """Whether this rank is still writing a save in flight (agreed on at each step's end)."""
        return self.background is not None and self.background.writing

    def save(
        self, step: int, model: nn.Module, optimizer: DataParallel, loader: BatchLoader
    ) -> None:
        """Saves optimizer step `step` (with checkpoint.async: starts saving it, after the
        previous save completes)."""
        if self.background is None:
            self.saved(save(self.setup, step, model, optimizer, loader))
            return
        self.finish()
        args = _save_args(self.setup, model, optimizer, loader)
        self.background.begin(checkpoint_dir(self.setup.cfg), step, **args)

    def poll(self, verdict: StepVerdict) -> None:
        """At a step's end: completes the save in flight if every rank's writer was done
        (`verdict.writing`, agreed on by every rank)."""
        if self.background is not None and self.background.pending and not verdict.writing:
            self.finish()

    def finish(self) -> None:
        """Completes the save in flight, if any, waiting for the writers (at the end of the
        run, a stop, the next save)."""
        if self.background is not None and self.background.pending is not None:
            self.saved(self.background.complete())

    def saved(self, path: Path | None) -> None:
        if path is not None and self.setup.ps.is_main:
            tqdm.write(f"saved {path}")

    def close(self, wait: bool = True) -> None:
        """Stops the writer thread (what it has not completed stays a temporary directory),
        waiting for it to end unless `wait` is false (a second Ctrl-C: at once)."""
        if self.background is not None:
            self.background.close(wait)


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
