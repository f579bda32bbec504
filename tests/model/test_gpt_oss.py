"""GPT-OSS's settings: a bad one is exit 2 in one line naming the key; a dense block (not in the
published models: model.moe.first_k_dense) adds its MLP's biases (the components against
transformers: tests/hf/test_hf_gpt_oss.py)."""

from __future__ import annotations

import pytest
import torch

from megatronish import ops
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from tests.conftest import CONFIGS, invoke_cli
from tests.tolerances import FP32_FEW_OPS_REL, FP32_GRAD_ABS

TINY = str(CONFIGS / "tiny-gpt-oss.yaml")


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            ["model.swiglu_limit=0"],
            "error: model.swiglu_limit: 0.0 is not valid; must be > 0 (gpt_oss: 7.0)",
        ),
        (
            ["parallel.tp=4", "model.n_kv_head=4", "model.d_model=130"],
            "error: model.d_model: 130 is not divisible by parallel.tp=4 (the experts' down "
            "biases split over tp)",
        ),
    ],
)
def test_a_bad_gpt_oss_setting_is_exit_2_in_one_line_naming_the_key(sets, line):
    result = invoke_cli("check", "--config", TINY, *(f"--set={s}" for s in sets))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line]


def test_a_dense_gpt_oss_block_adds_its_gate_up_and_down_biases():
    """The first_k_dense block's MLP: down(clamped_swiglu(gate(x) + b_g, up(x) + b_u)) + b_d,
    every bias reached by the gradient (fp32, a few ops: FP32_FEW_OPS_REL)."""
    sets = ["model.n_layer=2", "model.layer_types=[sliding_attention, full_attention]"]
    sets += ["model.moe.first_k_dense=1", "model.d_ff=48", "model.d_model=32"]
    cfg = load_config(TINY, [*sets, "model.vocab_size=61", "model.swiglu_limit=0.5"])
    torch.manual_seed(0)
    mlp = GPT(cfg, derive(cfg, 1), ParallelState.single()).blocks["0"].mlp
    with torch.no_grad():
        for layer in (mlp.gate, mlp.up, mlp.down):
            layer.bias.normal_(0, 0.5)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    out = mlp(x)
    gate = x @ mlp.gate.weight.T + mlp.gate.bias
    up = x @ mlp.up.weight.T + mlp.up.bias
    want = ops.activate("clamped_swiglu", gate, up, 0.5) @ mlp.down.weight.T + mlp.down.bias
    torch.testing.assert_close(out, want, rtol=FP32_FEW_OPS_REL, atol=FP32_GRAD_ABS)
    out.sum().backward()
    for layer in (mlp.gate, mlp.up, mlp.down):
        assert layer.bias.grad is not None and layer.bias.grad.abs().sum() > 0
