"""`megatronish` with a fault injected into one rank, for tests/test_faults.py (no tests here).

    torchrun ... tests/faulty_rank.py train --config ...

FAULT=nan|raise, FAULT_RANK=r, FAULT_STEPS=3,5,6: at those steps (1-based), rank r's loss is
multiplied by NaN before backward (so its loss and gradients are NaN), or rank r raises.
"""

from __future__ import annotations

import os

from megatronish.cli import main
from megatronish.trainer import Trainer

KIND = os.environ["FAULT"]
RANK = int(os.environ["FAULT_RANK"])
STEPS = {int(s) for s in os.environ["FAULT_STEPS"].split(",")}
compute_gradients = Trainer.compute_gradients


def faulty_compute_gradients(self: Trainer) -> tuple[float, float]:
    step = self.step + 1
    if self.ps.rank != RANK or step not in STEPS:
        return compute_gradients(self)
    if KIND == "raise":
        raise RuntimeError(f"injected failure on rank {RANK} at step {step}")
    model_loss = self.model.loss
    self.model.loss = lambda *args: model_loss(*args) * float("nan")
    try:
        return compute_gradients(self)
    finally:
        del self.model.loss  # the class's method again


Trainer.compute_gradients = faulty_compute_gradients
main()
