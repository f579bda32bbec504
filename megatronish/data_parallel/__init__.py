"""Data parallelism: each rank trains on its share of the global batch, and the gradients are
reduced over the dp x cp group. The gradients go through buckets (buckets.py), reduced while
backward runs, or after it for the parameters summed over another group first (outside.py);
one class per ZeRO level says what it shards and which collectives it issues:

    zero0  nothing sharded: an all-reduce per bucket
    zero1  optimizer state: a reduce-scatter per bucket, the parameters all-gathered after the step
    zero2  and gradients: a reduce-scatter per bucket per micro-batch
    zero3  and parameters: each module's all-gathered when it runs (param_shards.py)

The step loop sees one DataParallel (base.py), made by data_parallel_for.
"""

from __future__ import annotations

from torch import nn

from megatronish.config import Config
from megatronish.data_parallel.base import DataParallel
from megatronish.data_parallel.zero0 import Zero0
from megatronish.data_parallel.zero1 import Zero1
from megatronish.data_parallel.zero2 import Zero2
from megatronish.data_parallel.zero3 import Zero3
from megatronish.distributed.layout import ParallelState

LEVELS: dict[int, type[DataParallel]] = {0: Zero0, 1: Zero1, 2: Zero2, 3: Zero3}


def data_parallel_for(
    model: nn.Module, cfg: Config, ps: ParallelState, buckets: bool = True
) -> DataParallel:
    """The DataParallel of model at optim.zero (ZeRO-0 where the dp x cp group is one rank:
    there is nothing to shard); buckets: see DataParallel."""
    level = cfg.optim.zero if ps.dp_cp > 1 else 0
    return LEVELS[level](model, cfg, ps, buckets)


__all__ = ["DataParallel", "data_parallel_for"]
