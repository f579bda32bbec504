"""torch.profiler traces of chosen optimizer steps, one file per rank, and the named ranges that
`megatronish trace` reads from them.

``StepProfiler`` records steps observe.profile_steps ("A:B", both included) on the ranks of
observe.profile_ranks into <run.out_dir>/traces/rank_R.json.gz, a Chrome trace. Each recorded step
is a range named "step N"; inside it the model marks its layers ("embed", "block I", "loss")
and megatronish.distributed.comm its collectives, "comm:<op>:<group>" with the group's mesh name
(comm:all_reduce:tp[0,1], comm:cp_ring:cp[0,1]; comm:p2p:p2p for the pipeline's point-to-point
operations). Those ranges go through ``annotate``, which costs one flag test while nothing
records.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megatronish.config import Config, profile_ranks, profile_steps
from megatronish.observe.quiet import native_noise_filtered

# Whether a StepProfiler of this process is recording: annotate's ranges exist only then.
_RECORDING = False
_NOTHING = contextlib.nullcontext()


def annotate(name: str) -> contextlib.AbstractContextManager:
    """A profiler range called name around the block it wraps while a StepProfiler records in
    this process; otherwise a shared no-op context, so it can wrap every layer and collective."""
    return record_function(name) if _RECORDING else _NOTHING


def comm_range(op: str, group_name: str) -> contextlib.AbstractContextManager:
    """annotate's range for collective op (all_reduce, all_gather, reduce_scatter, broadcast, p2p,
    cp_ring) on the group with mesh name group_name: "comm:<op>:<group_name>"."""
    return record_function(f"comm:{op}:{group_name}") if _RECORDING else _NOTHING


def trace_path(out_dir: str | Path, rank: int) -> Path:
    """Where rank's trace of a run with run.out_dir out_dir goes."""
    return Path(out_dir) / "traces" / f"rank_{rank}.json.gz"


class StepProfiler:
    """Records this rank's steps observe.profile_steps when observe.profile_ranks selects it.
    The trainer calls begin_step(step) before optimizer step `step` (1-based) and end_step(step)
    after it, every step, and close() once at the end. Recording starts at the first step of the
    range it sees (a run resumed inside the range records the rest of it) and the trace is
    written when the last one ends, or at close() if the run stops before it. On any other rank,
    or without profile_steps, every call returns at once.

    Starting the profiler takes a moment, longer on some ranks than on others, so the first
    traced step's first collectives also hold the wait for the slowest rank to start."""

    def __init__(self, cfg: Config, rank: int, device: torch.device):
        steps, ranks = profile_steps(cfg), profile_ranks(cfg)
        self.steps = steps if steps is not None and (ranks is None or rank in ranks) else None
        self.path = trace_path(cfg.run.out_dir, rank)
        self.device = torch.device(device)
        self.profiler: profile | None = None
        self.step_range: record_function | None = None
        self.done = False

    def begin_step(self, step: int) -> None:
        """Starts recording at the range's first step, and the "step N" range of a recorded
        step."""
        if self.steps is None or self.done or not self.steps[0] <= step <= self.steps[1]:
            return
        if self.profiler is None:
            self._start()
        self.step_range = record_function(f"step {step}")
        self.step_range.__enter__()

    def end_step(self, step: int) -> None:
        """Ends the "step N" range; after the range's last step, stops and writes the trace."""
        if self.profiler is None:
            return
        self._end_step_range()
        if step >= self.steps[1]:
            self._stop()

    def close(self) -> None:
        """Writes what is being recorded (a run that ended inside the range); later steps record
        nothing."""
        if self.profiler is not None:
            self._end_step_range()
            self._stop()
        self.done = True

    def _start(self) -> None:
        global _RECORDING
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities, record_shapes=False, with_stack=False)
        with native_noise_filtered():  # kineto's profiler_start marker
            self.profiler.start()
        _RECORDING = True

    def _end_step_range(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _stop(self) -> None:
        """Stops the profiler and writes its Chrome trace, gzipped, in place of any older one."""
        global _RECORDING
        profiler, self.profiler, self.done = self.profiler, None, True
        _RECORDING = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with native_noise_filtered():  # kineto's profiler_stop marker
            profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        plain = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp.json")
        packed = plain.with_name(plain.name + ".gz")
        try:
            profiler.export_chrome_trace(str(plain))
            with open(plain, "rb") as source, gzip.open(packed, "wb", compresslevel=6) as target:
                shutil.copyfileobj(source, target)
            os.replace(packed, self.path)
        finally:
            plain.unlink(missing_ok=True)
            packed.unlink(missing_ok=True)
