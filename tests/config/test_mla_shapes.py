"""MLA's projection widths, derived once (config.mla_shapes) for the model and the accounting."""

from __future__ import annotations

from megatronish.config import load_config
from megatronish.config.mla_shapes import mla_shapes
from tests.conftest import CONFIGS


def test_deepseek_v3_mla_widths_are_the_published_projection_shapes():
    # 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64, v 128 (the published
    # checkpoint's q_b [24576, 1536], kv_a [576, 7168], kv_b [32768, 512], o [7168, 16384]).
    shapes = mla_shapes(load_config(CONFIGS / "deepseek-v3.yaml", []).model)
    assert (shapes.q_out, shapes.latent, shapes.kv_b_out, shapes.proj_in) == (
        24576,
        576,
        32768,
        16384,
    )
    assert shapes.entering_tp == 1536 + 576 and shapes.normed == 1536 + 512


def test_mla_widths_over_one_tp_ranks_heads_scale_with_the_heads():
    model = load_config(CONFIGS / "deepseek-v3.yaml", []).model
    whole, shard = mla_shapes(model), mla_shapes(model, model.n_head // 8)
    assert shard.q_out * 8 == whole.q_out and shard.kv_b_out * 8 == whole.kv_b_out
    assert shard.latent == whole.latent  # the latent is replicated
