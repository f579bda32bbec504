"""ZeRO-3: parameters sharded as well as gradients and AdamW state."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.data_parallel.base import Uses
from megatronish.data_parallel.buckets import Bucket
from megatronish.data_parallel.param_shards import ParamShards
from megatronish.data_parallel.zero2 import Zero2


class Zero3(Zero2):
    """ZeRO-2 whose buckets' parameters are sharded too (param_shards.ParamShards): each bucket
    holds the parameters of one module of the forward (model.forward_param_uses), so that a
    module's gather is its own buckets'. This rank keeps only its shard of each bucket's
    parameters, which AdamW updates; a module's buckets are all-gathered before its forward and
    its backward and freed after (a bucket once its gradients of that backward are
    reduce-scattered); with several micro-batches in flight (pp > 1) a gathered bucket stays
    until the step ends. No all-gather follows the step.

    Collectives per step: ZeRO-2's reduce-scatters, an all-gather of each module's buckets
    before its forward and before its backward (ParamShards says which), the owners'
    broadcasts and the norm's all-reduces as ZeRO-1."""

    def _parts(self, uses: Uses) -> dict[nn.Parameter, int]:
        """A bucket holds the parameters of one module of uses."""
        part_of: dict[nn.Parameter, int] = {}
        for index, (_, used) in enumerate(uses):
            for param in used:
                part_of.setdefault(param, index)
        return part_of

    def _lay_out_params(self) -> None:
        prefetch, keep = self.cfg.optim.zero3_prefetch, self.ps.pp > 1
        self.shards = ParamShards(self.buckets, self.layout.offsets, self.overlap, prefetch, keep)

    def _param_shard(self, bucket: Bucket) -> torch.Tensor:
        return bucket.param_shard

    def _hook_modules(self, uses: Uses) -> None:
        self.shards.register(self.layout.bucket_uses(uses))

    def _reduce_scatter(self, bucket: Bucket) -> None:
        super()._reduce_scatter(bucket)
        self.shards.backward_done(bucket)

    def _finish_buckets(self) -> None:
        super()._finish_buckets()
        self.shards.free_all()

    def _after_update(self) -> None:
        self.owners.broadcast()  # the buckets: each module gathers its own when it runs

    def after_eval(self) -> None:
        self.shards.free_all()  # what the output layer kept (no backward)

    def make_whole(self) -> None:
        self.shards.gather_all()  # freed again after their next use

    def whole_params(self, write_back: bool = False, params: list | None = None):
        return self.shards.gathered(write_back, params)

    def close(self) -> None:
        super().close()
        self.shards.close()
