"""Saving a checkpoint, atomically, from every rank of a run.

Protocol (each step ends with an agreement: an all-gather of the ranks' failures, so a rank that
fails makes every rank raise instead of leaving the others waiting in a barrier):
  1. rank 0 creates <dir>/step_NNNNNN.tmp-<pid of rank 0> (the pid is broadcast);
  2. every rank writes its files there, fsyncs them and keeps their CRC-32C: dp x cp rank 0 of
     each tp rank (and stage) its model shard, the other ep ranks of its ep group their
     experts; the ranks that hold optimizer state their optim shard (dp x cp rank 0, and the
     other ep ranks for their experts, without ZeRO; every dp x cp rank with ZeRO); every
     rank its RNG states;
  3. rank 0 gathers the checksums, writes config.yaml, the tokenizer and metadata.json (which
     lists every file with its size and CRC-32C), fsyncs, renames the directory to
     step_NNNNNN, replaces `latest` atomically, then deletes checkpoints beyond
     checkpoint.keep and leftovers of interrupted saves.
A crash at any point leaves `latest` naming the previous complete checkpoint. A file the system
refuses to write or rename (a full disk or quota, the file-size limit, a directory made
read-only) fails the save on every rank with the failing rank's one line (files.write_failures),
once rank 0 has removed the temporary directory. save_checkpoint runs the three steps at once;
checkpoint.async_save runs step 1 and the copy of the state at the save, step 2's writing in a
background thread, and the rest at a later step (open_save, complete_save). What each rank
writes in step 2: checkpoint.rank_files.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from megatronish.checkpoint.format import (
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    TOKENIZER_FILE,
    TensorSpec,
    all_stage_specs,
    complete_steps,
    describe_file,
    metadata_json,
    step_dir_name,
)
from megatronish.checkpoint.integrity import CHECKSUM_KEY, first_message_of_ranks
from megatronish.checkpoint.rank_files import rank_files, whole_params, write_safetensors
from megatronish.config import Config, Derived
from megatronish.data.tokenizer import companion_files, tokenizer_id
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState
from megatronish.errors import ReportedError, RunFailure
from megatronish.files import fsync_path, write_failures, write_file, write_text_atomic


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer to record: kind (byte, bpe, file), end-of-text id, tokenizer.json or None,
    and the companion files that travel with tokenizer.json (data.tokenizer.companion_files)."""

    kind: str
    eot_id: int
    file: Path | None = None
    companions: tuple[Path, ...] = ()


def tokenizer_identity(tokenizer: TokenizerInfo | None) -> str | None:
    """The tokenizer_id of a recorded tokenizer, which data of that tokenizer shares; None for
    none (or a bpe/file tokenizer without its file)."""
    return tokenizer_id(tokenizer.kind, tokenizer.file) if tokenizer is not None else None


def tokenizer_of_checkpoint(step_dir: Path, meta: dict[str, Any]) -> TokenizerInfo | None:
    """The tokenizer a checkpoint (its step directory and metadata.json) records, with its
    tokenizer.json and companion files when it has them; None when it records none."""
    info = meta.get("tokenizer")
    if info is None:
        return None
    return _tokenizer_in(step_dir, info["kind"], info["eot_id"])


def tokenizer_of_dataset(dataset_dir: Path) -> TokenizerInfo | None:
    """The tokenizer a prepared dataset directory records; None for a Megatron prefix (it
    records none)."""
    from megatronish.data import read_metadata

    if not Path(dataset_dir).is_dir():
        return None
    meta = read_metadata(dataset_dir)
    return _tokenizer_in(Path(dataset_dir), meta["tokenizer"]["kind"], meta["eot_id"])


def _tokenizer_in(directory: Path, kind: str, eot_id: int) -> TokenizerInfo:
    """The tokenizer of a directory that holds it as a checkpoint or a dataset does."""
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        return TokenizerInfo(kind, eot_id)
    return TokenizerInfo(kind, eot_id, path, companion_files(directory))


def base_metadata(
    step: int,
    layout: dict[str, int],
    specs: dict[str, TensorSpec],
    vocab_size: int,
    padded_vocab_size: int,
    arch: str,
    optimizer_name: str | None,
    loader_state: dict | None,
    tokenizer: TokenizerInfo | None,
) -> dict[str, Any]:
    """metadata.json's content, less the file list that finalize() adds."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        writer = f"megatronish {version('megatronish')}"
    except PackageNotFoundError:
        writer = "megatronish"
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": layout,
        "arch": arch,
        "vocab_size": vocab_size,
        "padded_vocab_size": padded_vocab_size,
        "tensors": specs,
        "optimizer": {"kind": optimizer_name} if optimizer_name is not None else None,
        "loader": loader_state,
        "tokenizer": None
        if tokenizer is None
        else {
            "kind": tokenizer.kind,
            "eot_id": tokenizer.eot_id,
            "file": TOKENIZER_FILE if tokenizer.file is not None else None,
        },
        "created_by": writer,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def finalize(
    directory: Path,
    tmp: Path,
    meta: dict[str, Any],
    cfg: Config,
    tokenizer: TokenizerInfo | None,
    keep: int,
    checksums: dict[str, str],
) -> Path:
    """Step 3 of the protocol (one process): returns the step directory. `checksums`: the
    CRC-32C of every shard file, by name, as its writer computed it."""
    meta = dict(meta, files={})
    for child in sorted(tmp.iterdir()):
        described = describe_file(child.name)
        if described is not None:
            info = dict(described, bytes=child.stat().st_size)
            info[CHECKSUM_KEY] = checksums[child.name]
            meta["files"][child.name] = info
    if tokenizer is not None and tokenizer.file is not None:
        files = [(tokenizer.file, TOKENIZER_FILE), *((p, p.name) for p in tokenizer.companions)]
        for source, name in files:
            needed = source.stat().st_size if source.is_file() else None
            with write_failures(tmp / name, needed):
                shutil.copyfile(source, tmp / name)
                fsync_path(tmp / name)
    for name, text in (
        (CONFIG_FILE, yaml.safe_dump(cfg.to_dict(), sort_keys=False)),
        (METADATA_FILE, metadata_json(meta)),
    ):
        write_file(tmp / name, text.encode("utf-8"))
    final = directory / step_dir_name(meta["step"])
    aside = None
    with write_failures(tmp):
        fsync_path(tmp)
        if final.exists():  # the same step saved before (a run resumed from an older checkpoint)
            aside = directory / f"{final.name}.old-{os.getpid()}"
            os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except OSError:
            if aside is not None:  # the earlier save of this step stays where it was
                os.rename(aside, final)
            raise
        fsync_path(directory)
    if aside is not None:  # before `latest`: a failure there must not leave a second copy
        shutil.rmtree(aside, ignore_errors=True)
    pointer = final.name + "\n"
    with write_failures(directory / LATEST_FILE, len(pointer)):
        write_text_atomic(directory / LATEST_FILE, pointer)
    prune(directory, keep, final)
    return final


def prune(directory: Path, keep: int, current: Path) -> None:
    """Deletes all but the `keep` newest complete checkpoints (0: keeps all; never `current`),
    and what interrupted saves left: their temporary directories and the earlier copies of a
    re-saved step (step_N.old-PID)."""
    if keep > 0:
        for old in complete_steps(directory)[:-keep]:
            if old != current:
                shutil.rmtree(old, ignore_errors=True)
    for child in directory.iterdir():
        leftover = ".tmp-" in child.name or ".old-" in child.name
        if child.name.startswith("step_") and leftover and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def _agree(error: BaseException | None, ps: ParallelState, what: str, tmp: Path) -> None:
    """Raises on every rank if any rank failed (an all-gather of the ranks' messages), rank 0
    first removing the save's temporary directory `tmp`. A ReportedError (a file the system
    refused: write_failures) is the first failing rank's one line, raised on every rank as a
    RunFailure that rank 0 prints; any other exception is raised, with its traceback, where it
    happened, and on the other ranks is a RunFailure naming that rank."""
    message = None
    if isinstance(error, ReportedError):
        message = str(error)
    elif error is not None:
        message = (
            f"checkpoint save failed on rank {ps.rank} (while it tried to {what}): "
            f"{type(error).__name__}: {error}"
        )
    first = first_message_of_ranks(message, ps.world_size)
    if first is None:
        return
    if ps.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None and not isinstance(error, ReportedError):
        raise error
    raise RunFailure(first, rank0_prints=True) from error


def save_checkpoint(
    directory: str | Path,
    step: int,
    *,
    cfg: Config,
    derived: Derived,
    ps: ParallelState,
    model,
    optimizer=None,
    loader_state: dict | None = None,
    tokenizer: TokenizerInfo | None = None,
    keep: int = 0,
) -> Path:
    """Saves the model (and the optimizer, the loader position, every rank's RNG) as
    <directory>/step_<step>; every rank of the run calls it. Returns the step directory."""
    directory = Path(directory)
    tmp = open_save(directory, step, ps)
    checksums: dict[str, str] = {}
    error: BaseException | None = None
    try:
        with whole_params(optimizer):
            for name, tensors in rank_files(model, optimizer, ps).items():
                checksums[name] = write_safetensors(tmp / name, tensors)
    except Exception as exc:  # noqa: BLE001 - reported to the other ranks, then re-raised
        error = exc
    return complete_save(
        directory,
        tmp,
        step,
        checksums,
        error,
        cfg=cfg,
        derived=derived,
        ps=ps,
        model=model,
        optimizer=optimizer,
        loader_state=loader_state,
        tokenizer=tokenizer,
        keep=keep,
    )


def open_save(directory: Path, step: int, ps: ParallelState) -> Path:
    """Step 1 of the protocol (every rank calls it; a broadcast and an agreement): the
    temporary step directory every rank writes its files into."""
    token = torch.tensor([os.getpid()], dtype=torch.int64, device=ps.device)
    comm.broadcast(token, 0, None)
    tmp = directory / f"{step_dir_name(step)}.tmp-{int(token.item())}"
    error: BaseException | None = None
    if ps.is_main:
        try:
            with write_failures(tmp):
                directory.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
        except RunFailure as exc:
            error = exc
    _agree(error, ps, f"create {tmp}", tmp)
    return tmp


def complete_save(
    directory: Path,
    tmp: Path,
    step: int,
    checksums: dict[str, str],
    error: BaseException | None,
    *,
    cfg: Config,
    derived: Derived,
    ps: ParallelState,
    model,
    optimizer=None,
    loader_state: dict | None = None,
    tokenizer: TokenizerInfo | None = None,
    keep: int = 0,
) -> Path:
    """Steps 2 (its end) and 3 of the protocol, every rank once its files are written (or
    `error` stopped it): the ranks agree that every rank's files are on disk, rank 0 gathers
    their `checksums` and finalizes. Returns the step directory."""
    _agree(error, ps, f"write its files into {tmp}", tmp)
    if ps.world_size > 1:
        parts: list = [None] * ps.world_size
        dist.all_gather_object(parts, checksums)
        checksums = {name: value for part in parts for name, value in part.items()}
    specs = all_stage_specs(model, ps)
    if ps.is_main:
        layout = {
            "tp": derived.tp,
            "dp": derived.dp,
            "pp": derived.pp,
            "cp": derived.cp,
            "ep": derived.ep,
            "zero": cfg.optim.zero if optimizer is not None and optimizer.zero else 0,
            "world_size": ps.world_size,
        }
        meta = base_metadata(
            step,
            layout,
            specs,
            derived.vocab_size,
            derived.padded_vocab_size,
            cfg.model.arch,
            None if optimizer is None else optimizer.optim.name,
            loader_state,
            tokenizer,
        )
        try:
            finalize(directory, tmp, meta, cfg, tokenizer, keep, checksums)
        except Exception as exc:  # noqa: BLE001
            error = exc
    _agree(error, ps, "finish the save", tmp)
    return directory / step_dir_name(step)
