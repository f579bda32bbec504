"""Dropout randomness: recomputation replays the same masks, so activation checkpointing
(selective or full) gives the same loss and gradients as keeping the activations."""

from __future__ import annotations

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState, RNGTracker
from megatronish.model import GPT
from megatronish.objectives.registry import sequence_losses
from tests.tolerances import FP32_FEW_OPS_REL, FP32_GRAD_ABS


def loss_and_grads(arch: str, checkpointing: str):
    cfg = load_config(
        None,
        [
            f"model.arch={arch}",
            "model.n_layer=2",
            "model.d_model=32",
            "model.dropout=0.2",
            "model.vocab_size=50",
            "model.max_seq_len=16",
            "train.seq_len=16",
            f"train.activation_checkpointing={checkpointing}",
        ],
    )
    model = GPT(cfg, derive(cfg, 1), ParallelState.single())
    model.train()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (2, 16), generator=gen)
    torch.manual_seed(99)
    loss = sequence_losses(model, tokens, tokens.roll(-1, dims=1)).total
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("checkpointing", ["selective", "full"])
def test_activation_checkpointing_replays_dropout_masks(arch, checkpointing):
    ref_loss, ref_grads = loss_and_grads(arch, "none")
    loss, grads = loss_and_grads(arch, checkpointing)
    assert loss == ref_loss
    for name, grad in ref_grads.items():
        torch.testing.assert_close(
            grads[name], grad, rtol=FP32_FEW_OPS_REL, atol=FP32_GRAD_ABS, msg=name
        )


def test_tracker_streams_differ_per_tp_rank_and_leave_the_default_stream_alone():
    a = RNGTracker(seed=1, tp_rank=0, device=torch.device("cpu"))
    b = RNGTracker(seed=1, tp_rank=1, device=torch.device("cpu"))
    before = torch.get_rng_state()
    with a.fork():
        draw_a = torch.rand(4)
    with b.fork():
        draw_b = torch.rand(4)
    assert not torch.equal(draw_a, draw_b)
    assert torch.equal(torch.get_rng_state(), before), "fork leaves the default stream alone"
    with a.fork():
        assert not torch.equal(torch.rand(4), draw_a), "the stream advances across forks"
