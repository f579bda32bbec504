"""The optimizer interface (optim.interface): AdamW is found by name, declares the state a
checkpoint stores, and a ZeRO level that shards parameters refuses an optimizer that needs
them whole, in one line naming optim.zero."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatronish.checkpoint.format import OPTIM_KINDS
from megatronish.data_parallel.zero1 import Zero1
from megatronish.errors import UserError
from megatronish.optim.adamw import AdamW, AdamWOptimizer
from megatronish.optim.registry import optimizer_named


class _NeedsMatricesWhole(AdamWOptimizer):
    name = "whole-matrices"

    def needs_whole(self, param: nn.Parameter) -> bool:
        return param.dim() == 2


def test_adamw_is_registered_by_name_and_declares_the_state_a_checkpoint_stores():
    adamw = optimizer_named("adamw")
    assert isinstance(adamw, AdamWOptimizer)
    assert adamw.state.kinds == ("exp_avg", "exp_avg_sq", "step")
    assert set(adamw.state.kinds) <= set(OPTIM_KINDS)  # what an optim file may hold
    param = nn.Parameter(torch.ones(3, 2))
    assert not adamw.needs_whole(param)
    cfg = SimpleNamespace(
        train=SimpleNamespace(lr=0.1), optim=SimpleNamespace(beta1=0.9, beta2=0.95, eps=1e-8)
    )
    update = adamw.build(adamw.param_groups(nn.Linear(2, 3), 0.1), cfg)
    assert isinstance(update, AdamW)
    assert [g["weight_decay"] for g in update.param_groups] == [0.1, 0.0]


def test_a_sharding_zero_level_refuses_an_optimizer_that_needs_whole_parameters():
    level = SimpleNamespace(
        layout=SimpleNamespace(
            members=[nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4, 8))]
        ),
        optim=_NeedsMatricesWhole(),
        cfg=SimpleNamespace(optim=SimpleNamespace(zero=2)),
    )
    with pytest.raises(UserError) as err:
        Zero1._refuse_split_wholes(level)
    assert str(err.value) == (
        "optim.zero: the whole-matrices optimizer needs whole parameters (e.g. one of shape "
        "(4, 8)), and optim.zero 2 shards them (not supported yet); valid: optim.zero 0"
    )
    level.optim = AdamWOptimizer()
    Zero1._refuse_split_wholes(level)  # elementwise: any piece updates on its own
