"""Dropout randomness: recomputation replays the same masks, so activation checkpointing
(selective or full) gives the same loss and gradients as keeping the activations, bit for bit
(the recomputed forward is the same arithmetic); also through GPT-OSS's sinks, biased experts and
clamped SwiGLU and Gemma 3's sandwich norms, soft-capping and per-layer RoPE."""

from __future__ import annotations

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState, RNGTracker
from megatronish.model import GPT
from megatronish.objectives.registry import sequence_losses
from tests.tolerances import FP32_FEW_OPS_REL, FP32_GRAD_ABS

# Small settings of the families whose presets are published sizes: a sliding block then a full
# one; GPT-OSS's 4 biased experts (every one routed some tokens) behind a clamp that binds.
WINDOWS = ["model.sliding_window=5", "model.layer_types=[sliding_attention, full_attention]"]
HEADS = ["model.n_head=4", "model.n_kv_head=2", "model.head_dim=8"]
FAMILY_SETTINGS = {
    "gpt2": [],
    "llama": [],
    "gemma3": [
        *HEADS,
        *WINDOWS,
        "model.query_pre_attn_scalar=8",
        "model.attn_logit_softcapping=2",
        "model.final_logit_softcapping=3",
    ],
    "gpt_oss": [
        *HEADS,
        *WINDOWS,
        "model.swiglu_limit=0.1",
        "model.moe.num_experts=4",
        "model.moe.top_k=2",
        "model.moe.d_ff=24",
    ],
}


def loss_and_grads(arch: str, checkpointing: str, dropout: float = 0.2):
    cfg = load_config(
        None,
        [
            f"model.arch={arch}",
            *FAMILY_SETTINGS[arch],
            "model.n_layer=2",
            "model.d_model=32",
            f"model.dropout={dropout}",
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


@pytest.mark.parametrize("arch", list(FAMILY_SETTINGS))
@pytest.mark.parametrize("checkpointing", ["selective", "full"])
def test_activation_checkpointing_replays_dropout_masks_and_gives_the_same_bits(
    arch, checkpointing
):
    ref_loss, ref_grads = loss_and_grads(arch, "none")
    loss, grads = loss_and_grads(arch, checkpointing)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_attention_under_dropout_keeps_its_sinks_and_soft_capping(arch):
    """A dropout too small to drop anything (1e-12: every keep probability rounds to 1 in fp32,
    and its 1 / (1 - p) too) gives the loss and gradients of no dropout: the dropout path
    computes the same attention, only in another order."""
    ref_loss, ref_grads = loss_and_grads(arch, "none", dropout=0.0)
    loss, grads = loss_and_grads(arch, "none", dropout=1e-12)
    assert abs(loss - ref_loss) <= FP32_FEW_OPS_REL * abs(ref_loss)
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
