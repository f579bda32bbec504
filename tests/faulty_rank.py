"""`megatronish` with faults injected into one rank, for tests/training/test_faults.py (no
tests here).

    torchrun ... tests/faulty_rank.py train --config ...

FAULT_RANK=r; FAULT_NAN_STEPS=3,4: at those steps (1-based) rank r's loss is multiplied by NaN
before backward, so its loss and gradients are NaN; FAULT_RAISE_STEP=5: rank r raises there;
FAULT_HANG_STEP=3 with FAULT_HANG_S=10: rank r stops calling collectives at the start of that
step, blocked for that many seconds, while the other ranks go on into the step's collectives.
FAULT_HOLD_WRITE_STEP=4 with FAULT_HOLD_WRITE_S=60 and FAULT_HOLD_MARKER=FILE (checkpoint.async):
rank r's background writer, having written the first file of step 4's save, creates FILE and
holds there for that many seconds, so a save is in flight for certain while the test acts (only
in a run's first attempt: a run torchrun restarts writes normally).
FAULT_FSIZE=BYTES: rank r's process can write no file larger than that (RLIMIT_FSIZE, with
SIGXFSZ ignored so that a write past it fails with EFBIG instead of killing the process).
FAULT_START_S=S: rank r starts the command S seconds after the others.
FAULT_HOLD_DONE=run|exit with FAULT_HOLD_DONE_MARKER=FILE: once rank r's run has returned (its
last save on disk), it creates FILE and holds until the test removes it (at most 120 s): at the
end of the training function (run), or in an atexit callback as the interpreter exits (exit).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import resource
import signal
import time
from pathlib import Path

from megatronish.checkpoint import async_save
from megatronish.cli import main
from megatronish.training.trainer import Trainer

RANK = int(os.environ["FAULT_RANK"])
NAN_STEPS = {int(s) for s in os.environ.get("FAULT_NAN_STEPS", "").split(",") if s}
RAISE_STEP = int(os.environ.get("FAULT_RAISE_STEP", "0"))
HANG_STEP = int(os.environ.get("FAULT_HANG_STEP", "0"))
HANG_S = float(os.environ.get("FAULT_HANG_S", "0"))
HOLD_WRITE_STEP = int(os.environ.get("FAULT_HOLD_WRITE_STEP", "0"))
HOLD_WRITE_S = float(os.environ.get("FAULT_HOLD_WRITE_S", "0"))
FSIZE = int(os.environ.get("FAULT_FSIZE", "0"))
START_S = float(os.environ.get("FAULT_START_S", "0"))
HOLD_DONE = os.environ.get("FAULT_HOLD_DONE", "")
compute_gradients = Trainer.compute_gradients
run = Trainer.run
write_file = async_save.write_file


def faulty_compute_gradients(self: Trainer) -> tuple[float, float]:
    step = self.step + 1
    if self.ps.rank == RANK and step == HANG_STEP:
        time.sleep(HANG_S)
    if self.ps.rank != RANK or step not in NAN_STEPS | {RAISE_STEP}:
        return compute_gradients(self)
    if step == RAISE_STEP:
        raise RuntimeError(f"injected failure on rank {RANK} at step {step}")
    objective = self.objective

    def nan_losses(model, micro):
        losses = objective(model, micro)
        nan = float("nan")
        return dataclasses.replace(losses, main=losses.main * nan, total=losses.total * nan)

    self.objective = nan_losses
    try:
        return compute_gradients(self)
    finally:
        self.objective = objective


def held_write_file(path: Path, tensors) -> str:
    checksum = write_file(path, tensors)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    marker = Path(os.environ["FAULT_HOLD_MARKER"])
    if (
        first_attempt
        and int(os.environ.get("RANK", "0")) == RANK
        and path.parent.name.startswith(f"step_{HOLD_WRITE_STEP:06d}.tmp-")
        and not marker.exists()
    ):
        marker.write_text(f"{path}\n")
        time.sleep(HOLD_WRITE_S)
    return checksum


def hold_until_released() -> None:
    marker = Path(os.environ["FAULT_HOLD_DONE_MARKER"])
    marker.write_text("held\n")
    deadline = time.monotonic() + 120
    while marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def held_run(self: Trainer) -> dict:
    last = run(self)
    if self.ps.rank == RANK:
        hold_until_released()
    return last


Trainer.compute_gradients = faulty_compute_gradients
if HOLD_DONE == "run":
    Trainer.run = held_run
if HOLD_DONE == "exit" and int(os.environ.get("RANK", "0")) == RANK:
    atexit.register(hold_until_released)
if HOLD_WRITE_STEP:
    async_save.write_file = held_write_file
if FSIZE and int(os.environ.get("RANK", "0")) == RANK:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))
if START_S and int(os.environ.get("RANK", "0")) == RANK:
    time.sleep(START_S)
main()
