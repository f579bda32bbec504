"""megatronish's AdamW makes torch.optim.AdamW(fused=True)'s update, bit for bit, without
importing torch.optim's compiler stack."""

from __future__ import annotations

import sys

import torch
from torch import nn

from megatronish.optim.adamw import AdamW
from tests.ranks import run_on_ranks


def _pair(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (7,), (3, 3), (4, 2)]
    ours = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


def _groups(params):
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def test_adamw_equals_torch_fused_adamw_bitwise_over_steps_with_skipped_gradients():
    ours, theirs = _pair()
    mine = AdamW(_groups(ours), lr=3e-2, betas=(0.9, 0.95), eps=1e-8)
    reference = torch.optim.AdamW(_groups(theirs), lr=3e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for group in mine.param_groups + reference.param_groups:
            group["lr"] = 3e-2 / (step + 1)
        for index, (a, b) in enumerate(zip(ours, theirs)):
            grad = torch.randn(a.shape, generator=gen)
            skipped = index == 2 and step in (1, 2)  # no gradient: no update, no state step
            a.grad = None if skipped else grad.clone()
            b.grad = None if skipped else grad.clone()
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        got, want = mine.state[a], reference.state[b]
        assert torch.equal(got["step"], want["step"])
        assert torch.equal(got["exp_avg"], want["exp_avg"])
        assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])
    assert float(mine.state[ours[2]]["step"]) == 4.0


def _step_in_a_fresh_process(rank, world):
    """In a process that has imported torch and megatronish but not torch.optim's compiler
    stack: one AdamW step; whether torch._dynamo got imported."""
    assert "torch._dynamo" not in sys.modules
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    AdamW([{"params": [p], "weight_decay": 0.1}], lr=0.1, betas=(0.9, 0.95), eps=1e-8).step()
    assert not torch.equal(p.detach(), torch.ones(3))
    return "torch._dynamo" in sys.modules


def test_adamw_step_does_not_import_the_compiler_stack():
    assert run_on_ranks(_step_in_a_fresh_process, 1, timeout=60) == [False]
