"""RoPE's scaled frequencies (megatronish.ops.rope): from a model config, the inverse
frequencies and the attention factor of llama3 and yarn equal what transformers'
ROPE_INIT_FUNCTIONS computes for the same config.json values, and the cos / sin table is scaled
by the attention factor at any positions."""

from __future__ import annotations

import pytest
import torch
import yaml

from megatronish.config import load_config
from megatronish.ops.rope import rope_spec, rope_table

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tests.tolerances import EXACT, FP64_REORDER  # noqa: E402

CPU = torch.device("cpu")


def llama3(factor: float, low: float, high: float, original: int) -> dict:
    return dict(
        type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def yarn(factor: float, original: int, **optional) -> dict:
    return dict(type="yarn", factor=factor, original_max_position_embeddings=original, **optional)


# (rope_theta, head_dim, model.rope_scaling): published and edge settings of both types.
CASES = {
    "llama3 Llama-3.1-8B": (500000.0, 128, llama3(8.0, 1.0, 4.0, 8192)),
    "llama3 Llama-3.2-1B": (500000.0, 64, llama3(32.0, 1.0, 4.0, 8192)),
    "llama3 every band at head dim 16": (10000.0, 16, llama3(4.0, 1.5, 4.0, 64)),
    "yarn Qwen": (1000000.0, 128, yarn(4.0, 32768)),
    "yarn betas untruncated": (
        10000.0,
        64,
        yarn(8.0, 4096, beta_fast=16.0, beta_slow=2.0, truncate=False),
    ),
    "yarn mscale over mscale_all_dim": (
        10000.0,
        64,
        yarn(40.0, 4096, mscale=1.0, mscale_all_dim=0.707),
    ),
    "yarn attention_factor given": (10000.0, 64, yarn(2.0, 4096, attention_factor=1.5)),
}


def _spec(theta: float, scaling: dict):
    """Our RopeSpec of a config that sets model.rope_scaling to `scaling` (one --set)."""
    flow = yaml.safe_dump(scaling, default_flow_style=True).strip()
    sets = ["model.arch=llama", f"model.rope_theta={theta}", f"model.rope_scaling={flow}"]
    return rope_spec(load_config(None, sets).model)


def _transformers(theta: float, head_dim: int, scaling: dict):
    """(inverse frequencies, attention factor) of transformers for this config.json."""
    params = {"rope_type" if k == "type" else k: v for k, v in scaling.items()}
    context = int(scaling["factor"] * scaling["original_max_position_embeddings"])
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=context,
        rope_parameters={**params, "rope_theta": theta},
    )
    return ROPE_INIT_FUNCTIONS[scaling["type"]](config, CPU)


@pytest.mark.parametrize("name", list(CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name):
    theta, head_dim, scaling = CASES[name]
    spec = _spec(theta, scaling)
    want, want_factor = _transformers(theta, head_dim, scaling)
    got = spec.inverse_frequencies(head_dim, CPU)
    assert got.dtype == want.dtype == torch.float32
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert not torch.equal(want, plain), "the setting scales some frequency"
    assert ((got - want).abs() / want).max().item() <= EXACT  # the same fp32 ops
    assert spec.attention_factor() == pytest.approx(want_factor, rel=FP64_REORDER)


def test_the_table_at_given_positions_is_the_scaled_table_at_those_rows():
    theta, head_dim, scaling = CASES["yarn Qwen"]
    spec = _spec(theta, scaling)
    cos, sin = rope_table(spec, 40, head_dim, CPU)
    factor = spec.attention_factor()
    angles = torch.outer(torch.arange(40.0), spec.inverse_frequencies(head_dim, CPU))
    torch.testing.assert_close(cos, angles.cos() * factor, rtol=EXACT, atol=EXACT)
    positions = torch.tensor([[3, 0, 39], [7, 8, 9]])
    at_cos, at_sin = rope_table(spec, 3, head_dim, CPU, positions=positions)
    assert torch.equal(at_cos, cos[positions]) and torch.equal(at_sin, sin[positions])
    assert torch.equal(rope_table(spec, 5, head_dim, CPU, start_pos=35)[1], sin[35:])
