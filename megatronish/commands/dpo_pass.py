"""The line `check` and `plan` print for a DPO run (train.objective dpo on a preference
dataset): its one-time reference pass, as accounting.dpo counts it from the dataset's pairs."""

from __future__ import annotations

from megatronish.accounting.dpo import reference_pass
from megatronish.config import Config


def reference_pass_lines(
    cfg: Config, step_flops: float, step_time_s: float | None = None
) -> list[str]:
    """[the reference pass's line] of a DPO run on one preference dataset (step_flops: a
    training step's model FLOPs; with step_time_s, its predicted seconds, the pass's too), else
    [] (what train refuses is said elsewhere)."""
    from megatronish.data.pairs import is_preference, split_pairs
    from megatronish.data.sources import run_data

    if cfg.train.objective != "dpo" or (cfg.data.path is None and cfg.data.blend is None):
        return []
    _, data = run_data(cfg)
    if data.blended or not is_preference(data.sources[0]):
        return []
    source = data.sources[0]
    train, val = (len(split_pairs(source, split)) for split in ("train", "val"))
    ref = reference_pass(cfg, step_flops, (train, val), source.meta["preference"]["pairs"])
    time = "" if step_time_s is None else f", ~{ref.seconds(step_time_s):.3g} s"
    return [
        f"DPO reference pass (once, before step 1): {train:,} train + {val:,} validation pairs "
        f"in {ref.batches:,} global batches, {ref.tokens:,} forward tokens, "
        f"{ref.flops:.3g} model FLOPs{time}; its table {ref.table_bytes:,} bytes on every rank "
        f"({ref.working_bytes:,} while computed)"
    ]
