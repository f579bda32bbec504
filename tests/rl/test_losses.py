"""The RL losses (megatronish.rl.losses) on packed rows equal trl's GRPOTrainer._compute_loss
on the same per-token log-probabilities and advantages: loss value and gradients, for every
loss type, with and without a KL term and old log-probabilities, whatever the packing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatronish.rl.losses import LossSettings, policy_loss
from megatronish.rl.packing import pack
from megatronish.rl.rollouts import Rollouts, completion_counts, shard_terms
from tests.rl.trl_loss import trl_loss
from tests.tolerances import EXACT, FP32_FEW_OPS_REL

LENGTHS = [7, 12, 4, 9, 15, 6]
PROMPTS = [3, 5, 1, 9, 2, 6]  # sequence 5's prompt is all of it but its last token; 2 has p=1


def _rollouts(with_old: bool, with_ref: bool):
    gen = torch.Generator().manual_seed(3)
    logps = [(-torch.rand(n - 1, generator=gen) * 3).requires_grad_(True) for n in LENGTHS]
    near = [lp.detach() + 0.4 * torch.randn(lp.shape, generator=gen) for lp in logps]
    ref = [lp.detach() + 0.3 * torch.randn(lp.shape, generator=gen) for lp in logps]
    advantages = torch.randn(len(LENGTHS), generator=gen).tolist()
    seqs = [[0] * n for n in LENGTHS]
    rollouts = Rollouts(
        seqs, PROMPTS, advantages, near if with_old else None, ref if with_ref else None
    )
    return logps, rollouts


def _ours(kind, logps, rollouts, settings, budget, longest):
    rows = pack(LENGTHS, budget)
    total = torch.zeros(())
    for row in rows:
        terms = shard_terms(rollouts.terms(row, kind, longest), 1, 0, torch.device("cpu"))
        pieces = []
        for index in row.members:
            pieces += [logps[index], torch.zeros(1)]  # a sequence's last token: no target
        loss, _ = policy_loss(torch.cat(pieces), terms, settings)
        total = total + loss
    return total


def _trl(kind, logps, rollouts, settings, longest):
    counts = completion_counts(rollouts.seqs, rollouts.prompt_lens)
    width = max(counts)

    def padded(values):
        out = []
        for value, count in zip(values, counts, strict=True):
            tail = value[len(value) - count :]
            out.append(torch.cat([tail, torch.zeros(width - count)]))
        return torch.stack(out)

    mask = torch.stack([torch.arange(width) < count for count in counts]).long()
    old = None if rollouts.old is None else padded(rollouts.old)
    ref = None if rollouts.ref is None else padded(rollouts.ref)
    trl_settings = dict(
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        kl_coef=settings.kl_coef,
        max_completion_length=longest,
    )
    advantages = torch.tensor(rollouts.advantages)
    return trl_loss(kind, padded(logps), mask, advantages, old, ref, trl_settings)


def _magnitude(kind, logps, rollouts, settings, longest) -> float:
    """The sum of the magnitudes of the loss's terms, which its roundings are relative to (the
    loss itself may cancel to near 0): the policy terms at |A| (all of one sign) plus the KL
    terms alone (each >= 0)."""
    absolute = dataclasses.replace(rollouts, advantages=[abs(a) for a in rollouts.advantages])
    no_kl = dataclasses.replace(settings, kl_coef=0.0)
    total = abs(_trl(kind, logps, absolute, no_kl, longest).item())
    if settings.kl_coef:
        zero = dataclasses.replace(rollouts, advantages=[0.0] * len(LENGTHS))
        total += _trl(kind, logps, zero, settings, longest).item()
    return total


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize(
    ("with_old", "kl_coef"), [(False, 0.0), (True, 0.0), (True, 0.05)], ids=["first", "old", "kl"]
)
def test_each_loss_equals_trls_in_value_and_gradient_at_any_packing(kind, with_old, kl_coef):
    logps, rollouts = _rollouts(with_old, kl_coef > 0)
    settings = LossSettings(kind, clip_low=0.2, clip_high=0.28, kl_coef=kl_coef)
    longest = 16  # dr_grpo's constant: trl's max_completion_length
    want = _trl(kind, logps, rollouts, settings, longest)
    magnitude = _magnitude(kind, logps, rollouts, settings, longest)
    want_grads = torch.autograd.grad(want, logps)
    for budget in (1, 20, 1000):  # one sequence a row, a few a row, all in one
        got = _ours(kind, logps, rollouts, settings, budget, longest)
        grads = torch.autograd.grad(got, logps)
        assert got.item() == pytest.approx(want.item(), abs=FP32_FEW_OPS_REL * magnitude)
        for ours, theirs in zip(grads, want_grads, strict=True):
            scale = theirs.abs().max().item()
            torch.testing.assert_close(ours, theirs, rtol=EXACT, atol=FP32_FEW_OPS_REL * scale)
