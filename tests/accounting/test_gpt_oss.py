"""GPT-OSS's parameters as counted: the tiny model's numel (sinks, the router's logit bias and
the experts' biases included), of its fp8 layers too (gpt-oss-20b's against transformers' count:
tests/hf/test_hf_gpt_oss.py); FLOPs with each block's window."""

from __future__ import annotations

import pytest

from megatronish.accounting.flops import attention_flops_per_token
from megatronish.accounting.model_state import fp8_layer_params
from megatronish.accounting.parameters import local_parameter_count, parameter_count
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatronish.model import GPT
from megatronish.moe.experts import GroupedExperts
from tests.conftest import CONFIGS
from tests.tolerances import FP64_REORDER

TINY = CONFIGS / "tiny-gpt-oss.yaml"


def test_parameter_counts_equal_the_numel_of_the_tiny_gpt_oss():
    cfg = load_config(TINY, ["model.vocab_size=256", "train.precision=fp8"])  # unpadded
    derived = derive(cfg, 1)
    model = GPT(cfg, derived, ParallelState.single())
    built = sum(p.numel() for p in model.parameters())
    assert parameter_count(cfg, derived) == built
    assert local_parameter_count(cfg, derived) == built
    linears = (ColumnParallelLinear, RowParallelLinear, GroupedExperts)
    fp8 = [m for m in model.blocks.modules() if isinstance(m, linears)]
    assert fp8_layer_params(cfg, derived, 0) == sum(p.numel() for m in fp8 for p in m.parameters())


def test_attention_flops_count_each_sliding_block_through_its_window():
    """Half the blocks see 128 keys where the others see 4096 (attention's s^2 term as the
    accounting counts it, per key)."""
    cfg = load_config(CONFIGS / "gpt-oss-20b.yaml")
    derived = derive(cfg, 8)
    full = load_config(
        CONFIGS / "gpt-oss-20b.yaml", ["model.layer_types=null", "model.sliding_window=null"]
    )
    windowed, unwindowed = (attention_flops_per_token(c, derived) for c in (cfg, full))
    assert windowed == pytest.approx(unwindowed * (1 + 128 / 4096) / 2, rel=FP64_REORDER)
