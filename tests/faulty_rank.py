"""`megatronish` with faults injected into one rank, for tests/test_faults.py (no tests here).

    torchrun ... tests/faulty_rank.py train --config ...

FAULT_RANK=r; FAULT_NAN_STEPS=3,4: at those steps (1-based) rank r's loss is multiplied by NaN
before backward, so its loss and gradients are NaN; FAULT_RAISE_STEP=5: rank r raises there;
FAULT_HANG_STEP=3 with FAULT_HANG_S=10: rank r stops calling collectives at the start of that
step, blocked for that many seconds, while the other ranks go on into the step's collectives.
"""

from __future__ import annotations

import os
import time

from megatronish.cli import main
from megatronish.training.trainer import Trainer

RANK = int(os.environ["FAULT_RANK"])
NAN_STEPS = {int(s) for s in os.environ.get("FAULT_NAN_STEPS", "").split(",") if s}
RAISE_STEP = int(os.environ.get("FAULT_RAISE_STEP", "0"))
HANG_STEP = int(os.environ.get("FAULT_HANG_STEP", "0"))
HANG_S = float(os.environ.get("FAULT_HANG_S", "0"))
compute_gradients = Trainer.compute_gradients


def faulty_compute_gradients(self: Trainer) -> tuple[float, float]:
    step = self.step + 1
    if self.ps.rank == RANK and step == HANG_STEP:
        time.sleep(HANG_S)
    if self.ps.rank != RANK or step not in NAN_STEPS | {RAISE_STEP}:
        return compute_gradients(self)
    if step == RAISE_STEP:
        raise RuntimeError(f"injected failure on rank {RANK} at step {step}")
    model_loss = self.model.loss
    self.model.loss = lambda *args: model_loss(*args) * float("nan")
    try:
        return compute_gradients(self)
    finally:
        del self.model.loss  # the class's method again


Trainer.compute_gradients = faulty_compute_gradients
main()
