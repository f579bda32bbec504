"""The accounting of Gemma 3 equals what the models hold and compute: its parameters (four norms
a block, tied embeddings) are transformers' count of Gemma3ForCausalLM at the published 27B
shapes and the numel of the tiny model, and its attention FLOPs count the window in the local
blocks only."""

from __future__ import annotations

import pytest
import torch

from megatronish.accounting.flops import attention_keys
from megatronish.accounting.parameters import local_parameter_count, parameter_count
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.hf import gemma3
from megatronish.model import GPT
from tests.conftest import CONFIGS


def test_the_parameters_of_gemma_3_27b_are_transformers_count_of_its_export():
    """The model transformers builds (on the meta device) from the config.json export writes."""
    transformers = pytest.importorskip("transformers")
    cfg = load_config(CONFIGS / "gemma-3-27b.yaml", [])
    derived = derive(cfg, 32)
    keys = gemma3.FAMILY.config_json(cfg, derived)
    keys = {k: v for k, v in keys.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**keys))
    count = sum(p.numel() for p in theirs.parameters())
    assert parameter_count(cfg, derived) == count == 27_009_346_304


def test_the_parameters_of_the_tiny_gemma3_are_the_numel_of_its_model():
    cfg = load_config(CONFIGS / "tiny-gemma3.yaml", ["model.vocab_size=256"])  # unpadded
    derived = derive(cfg, 1)
    built = sum(p.numel() for p in GPT(cfg, derived, ParallelState.single()).parameters())
    assert parameter_count(cfg, derived) == local_parameter_count(cfg, derived) == built


def test_the_attention_flops_count_the_window_in_the_local_blocks_only():
    """5 local blocks see their window of 32 of the 128 positions, the global one all."""
    cfg = load_config(CONFIGS / "tiny-gemma3.yaml", ["train.seq_len=128"])
    assert attention_keys(cfg) == 5 * 32 + 128
