"""fp8 in Qwen3.5's hybrid blocks: the Gated DeltaNet layer's five projections (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a and out_proj) take the fp8 GEMMs of train.precision fp8 as the
attention and MLP projections do, in every recipe, in_proj_b and in_proj_a too (value heads rows
wide: the emulated GEMMs and fp8_gemm take any row count); the convolution, the decay and the
delta rule's recurrence stay in the model's precision. A recipe trains such a model from the
CLI.

An fp8 GEMM's output is within |A_fp8| |B_fp8|^T - |A| |B|^T of the exact product (each cast
value within U_E5M2 of its operand or a subnormal's step: tests/tolerances.py's
fp8_product_magnitude) plus the fp32 sums' reordering; a plain fp32 GEMM is within the latter
alone, which the projections' outputs exceed (the casts happened)."""

from __future__ import annotations

import math

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.layers import linear
from megatronish.model import GPT
from tests.conftest import CONFIGS, SMALLEST_RUN, invoke_cli, read_metrics
from tests.tolerances import fp8_product_magnitude, reordered_sum_bound

RECIPES = ["tensorwise", "rowwise", "blockwise"]
# 1 linear-attention block to 1 full: 2 key heads of 16 dims, 4 value heads of 16.
HYBRID = [
    "model.n_layer=2",
    "model.layer_types=[linear_attention, full_attention]",
    "model.linear_num_key_heads=2",
    "model.linear_num_value_heads=4",
    "model.linear_key_head_dim=16",
    "model.linear_value_head_dim=16",
    "model.linear_conv_kernel_dim=4",
]
PROJECTIONS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def recorded_gemms(recipe: str, monkeypatch) -> tuple[GPT, dict]:
    """The tiny hybrid under train.precision fp8 in `recipe`, and each call of local_linear (the
    linear layers' GEMM at tp 1) in one forward, by its weight's id: (x, out, recipe)."""
    sets = [*SMALLEST_RUN, *HYBRID, "model.vocab_size=61", "train.precision=fp8"]
    cfg = load_config(CONFIGS / "tiny-qwen3_5.yaml", [*sets, f"train.fp8_recipe={recipe}"])
    torch.manual_seed(0)
    model = GPT(cfg, derive(cfg, 1), ParallelState.single())
    calls, original = {}, linear.local_linear

    def spy(x, weight, bias, recipe, split):
        out = original(x, weight, bias, recipe, split)
        calls[id(weight)] = (x.detach(), out.detach(), recipe)
        return out

    monkeypatch.setattr(linear, "local_linear", spy)
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens)
    return model, calls


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_linear_attention_projections_take_the_fp8_gemms_of_every_recipe(recipe, monkeypatch):
    model, calls = recorded_gemms(recipe, monkeypatch)
    layer = model.blocks["0"].attn
    assert type(layer).__name__ == "GatedDeltaNet"
    for name in PROJECTIONS:
        weight = getattr(layer, name).weight
        x, out, taken = calls[id(weight)]
        assert taken is not None and taken.name == recipe, name
        a, b = x.reshape(-1, x.shape[-1]), weight.detach()
        exact = (a.double() @ b.double().t()).view(out.shape)
        plain = (a.double().abs() @ b.double().abs().t()).view(out.shape)
        magnitude = fp8_product_magnitude(a, b).view(out.shape)
        summed = reordered_sum_bound(a.shape[-1] + 1)
        err = (out.double() - exact).abs()
        assert (err <= magnitude - plain + summed * magnitude).all(), name
        assert (err > summed * plain).any(), f"{name}: an fp32 GEMM's result, not fp8's"


def test_every_fp8_recipe_trains_a_hybrid_model_from_the_cli(tmp_path, small_dataset):
    for recipe in RECIPES:
        out = tmp_path / recipe
        sets = [*SMALLEST_RUN, *HYBRID, "train.precision=fp8", f"train.fp8_recipe={recipe}"]
        sets += ["train.steps=2", "train.log_every=1", "train.eval_every=0"]
        sets += [f"data.path={small_dataset}", f"run.out_dir={out}", "checkpoint.save=false"]
        args = [a for s in sets for a in ("--set", s)]
        result = invoke_cli("train", "--config", str(CONFIGS / "tiny-qwen3_5.yaml"), *args)
        assert result.returncode == 0, result.stderr[-3000:]
        losses = [line["loss"] for line in read_metrics(out)[0]]
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), recipe
