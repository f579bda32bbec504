"""Asynchronous checkpoint saves (checkpoint.async): the save protocol of checkpoint.save split
so that training waits only while the state is copied.

    begin     (training thread, every rank; collectives): step 1 of the protocol (the
              temporary step directory), then this rank's files copied into buffers it keeps
              from save to save (pinned host memory on a GPU, the copy queued on the current
              stream; a private copy on a CPU). ZeRO's gathers of whole-parameter state (and
              ZeRO-3's of the parameters) happen here, on the training thread. The writer
              thread is handed the copy.
    writer    (one background thread per process, no collective ever): writes this rank's
              files into the temporary directory, fsyncs them and keeps their CRC-32C.
    complete  (training thread, every rank at the same point; collectives): waits for this
              rank's writer, then steps 2 and 3 of the protocol: the ranks agree that every
              rank's files are on disk, rank 0 gathers the checksums, writes metadata.json,
              renames the directory into place, replaces `latest` and prunes. A file a
              writer could not write (a full disk, the file-size limit, a read-only
              directory) is raised here on every rank as the failing rank's one line.

Only the training thread ever calls a collective, so the saves never interleave with the
training's collectives on a process group. Until `complete` renames it, a save is a *.tmp-*
directory that resume never takes; a process that dies mid-write leaves only that.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatronish.checkpoint.rank_files import rank_files, whole_params, write_safetensors
from megatronish.checkpoint.save import complete_save, open_save
from megatronish.errors import UserError


@dataclass
class WriteJob:
    """One rank's share of a save in flight: its files (tensors in the saver's buffers), what
    `complete` needs, and what the writer found (checksums by file name, or an error)."""

    tmp: Path
    files: dict[str, dict[str, torch.Tensor]]
    ready: Any  # a CUDA event the copies were queued before, or None on a CPU
    save_args: dict[str, Any]
    checksums: dict[str, str] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            if self.ready is not None:
                self.ready.synchronize()
            for name, tensors in self.files.items():
                self.checksums[name] = write_file(self.tmp / name, tensors)
        except BaseException as exc:  # noqa: BLE001 - reported by complete(), on every rank
            self.error = exc
        finally:
            self.done.set()


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """One shard file written and fsynced by the writer thread; its CRC-32C. (The tests hold
    the writer mid-save by wrapping this function: tests/faulty_rank.py.)"""
    return write_safetensors(path, tensors)


class WriterThread(threading.Thread):
    """The process's checkpoint writer: runs the WriteJobs put on `jobs`, one at a time, until
    it gets None."""

    def __init__(self) -> None:
        super().__init__(name="checkpoint-writer", daemon=True)
        self.jobs: queue.Queue[WriteJob | None] = queue.Queue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job.run()


class AsyncSaver:
    """Saves in the background, at most one in flight. Starting it starts the writer thread: a
    UserError (exit 2, one line) where this process cannot start one."""

    def __init__(self) -> None:
        self.thread = WriterThread()
        try:
            self.thread.start()
        except RuntimeError as exc:  # "can't start new thread": a thread or memory limit
            raise UserError(
                f"checkpoint.async: this process cannot start a background writer thread "
                f"({exc}); raise the process's thread limit, or set checkpoint.async=false"
            ) from None
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.pending: WriteJob | None = None

    @property
    def writing(self) -> bool:
        """Whether this rank's writer is still writing the save in flight."""
        return self.pending is not None and not self.pending.done.is_set()

    def begin(self, directory: Path, step: int, **save_args) -> None:
        """Starts saving step `step` into `directory` (every rank calls it, with
        save_checkpoint's keyword arguments); a save still in flight must be completed first."""
        assert self.pending is None, "complete() the save in flight first"
        ps, model, optimizer = save_args["ps"], save_args["model"], save_args.get("optimizer")
        tmp = open_save(Path(directory), step, ps)
        files: dict[str, dict[str, torch.Tensor]] = {}
        error: BaseException | None = None
        with whole_params(optimizer):  # collectives on every rank; the copy is this rank's
            try:
                files = self.copy(rank_files(model, optimizer, ps), ps.device)
            except Exception as exc:  # noqa: BLE001 - e.g. no host memory for the copy
                error = exc
        ready = None
        if ps.device.type == "cuda" and error is None:
            ready = torch.cuda.Event()
            ready.record()
        save_args = dict(save_args, directory=Path(directory), step=step)
        self.pending = WriteJob(tmp, files, ready, save_args, error=error)
        if error is None:
            self.thread.jobs.put(self.pending)
        else:  # nothing to write: complete() reports the error on every rank, as a failed write
            self.pending.done.set()

    def copy(self, files: dict[str, dict[str, torch.Tensor]], device: torch.device) -> dict:
        """The files' tensors copied into this saver's buffers (allocated at the first save;
        on CUDA pinned, the copies queued on the current stream)."""
        pinned = device.type == "cuda"
        out: dict[str, dict[str, torch.Tensor]] = {}
        for file_name, tensors in files.items():
            out[file_name] = {}
            for name, tensor in tensors.items():
                buffer = self.buffers.get((file_name, name))
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
                    self.buffers[(file_name, name)] = buffer
                buffer.copy_(tensor.detach(), non_blocking=pinned)
                out[file_name][name] = buffer
        return out

    def complete(self) -> Path | None:
        """Completes the save in flight, waiting for this rank's writer first (every rank
        calls it at the same point of the run); returns its step directory, None when no save
        is in flight. Raises on every rank if any rank's writer failed."""
        job, self.pending = self.pending, None
        if job is None:
            return None
        job.done.wait()
        args = dict(job.save_args)
        directory, step = args.pop("directory"), args.pop("step")
        return complete_save(directory, job.tmp, step, job.checksums, job.error, **args)

    def close(self, wait: bool = True) -> None:
        """Stops the writer thread after the job it is running (a save not completed stays a
        temporary directory) and, unless `wait` is false, waits for it to end: a writer still
        alive as the interpreter exits would be ended inside a torch call, which aborts the
        process (SIGABRT). A second Ctrl-C does not wait: it stops the run at once."""
        self.thread.jobs.put(None)
        if wait:
            self.thread.join()
