"""metrics.jsonl's scalars, also as TensorBoard event files (observe.tensorboard) in
<run.out_dir>/tb, written by rank 0 through torch.utils.tensorboard.

Nested fields are flattened with "/" (phases/forward_s/max), so TensorBoard groups a phase's
min, median and max; strings and nulls are left out.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megatronish.errors import UserError


def check_available() -> None:
    """A UserError when the tensorboard package is missing (before any rank starts work)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError(
            "observe.tensorboard: needs the tensorboard package (pip install tensorboard, or "
            "pip install -e '.[dev]'); or set observe.tensorboard=false"
        )


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric fields of a metrics record, nested ones flattened with "/"; not "step"."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


class TensorBoardWriter:
    """Writes each metrics record's scalars at its step."""

    def __init__(self, out_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tb"))

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
