"""The accounting of Qwen3.5's hybrid (model.layer_types: Gated DeltaNet beside gated full
attention) equals what the model holds and computes: its parameters (the tp 2 counts are held
in tests/model/test_model.py) and the linear-attention layer's GEMM FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatronish.accounting.components import gated_deltanet
from megatronish.accounting.flops import attention_flops_per_token
from megatronish.accounting.parameters import local_parameter_count, parameter_count
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT

TINY = "configs/tiny-qwen3_5.yaml"
MOE = ["model.moe.num_experts=4", "model.moe.d_ff=64"]  # the preset's gated shared expert


@pytest.mark.parametrize("sets", [[], MOE], ids=["dense", "moe"])
def test_parameter_counts_equal_the_numel_of_the_tiny_hybrid(sets):
    cfg = load_config(TINY, ["model.vocab_size=256", *sets])  # 256: no vocab padding
    derived = derive(cfg, 1)
    built = sum(p.numel() for p in GPT(cfg, derived, ParallelState.single()).parameters())
    assert parameter_count(cfg, derived) == built
    assert local_parameter_count(cfg, derived) == built


def test_linear_attention_flops_equal_the_gemms_of_its_forward():
    """The projections (mm) and the chunked rule (bmm) as torch's flop counter counts them, on
    two chunks of 64 tokens; the convolution is not a matmul and not counted."""
    cfg = load_config(TINY, ["model.vocab_size=256"])
    derived, model = derive(cfg, 1), cfg.model
    layer = GPT(cfg, derived, ParallelState.single()).blocks["0"].attn
    batch, seq = 2, 128
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(batch, seq, model.d_model))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    tokens = batch * seq
    assert counts["aten.mm"] == 2 * tokens * gated_deltanet.matmul_params(model, derived)
    assert counts["aten.bmm"] == tokens * gated_deltanet.rule_gemm_flops_per_token(model)
    # Only the one full-attention block counts attention's s^2 terms.
    full = 2 * cfg.train.seq_len * model.n_head * 2 * derived.head_dim
    linear = 3 * gated_deltanet.rule_flops_per_token(model)
    assert attention_flops_per_token(cfg, derived) == full + linear
