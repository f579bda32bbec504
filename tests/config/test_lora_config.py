"""model.lora's bad values: exit 2 with one line naming the key and what is valid."""

from __future__ import annotations

import pytest

from tests.conftest import CONFIGS, invoke_cli

LLAMA = str(CONFIGS / "tiny-qwen3.yaml")
GPT2 = str(CONFIGS / "tiny.yaml")
MOE = str(CONFIGS / "tiny-qwen3-moe.yaml")


@pytest.mark.parametrize(
    "config, settings, needle",
    [
        (LLAMA, ["model.lora.rank=0"], "model.lora.rank: 0 is not valid; must be > 0"),
        (LLAMA, ["model.lora.alpha=0"], "model.lora.alpha: 0.0 is not valid; must be > 0"),
        (LLAMA, ["model.lora.targets=[q_proj,c_attn]"], "unknown 'c_attn'; valid: q_proj"),
        (
            MOE,
            ["model.lora.targets=[gate_proj]"],
            "gate_proj is not a projection LoRA adapts in this model",
        ),
        (
            LLAMA,
            ["model.lora.targets=[q_proj,experts.gate_up_proj]"],
            "experts.gate_up_proj is not a projection LoRA adapts in this model",
        ),
        (
            MOE,
            ["model.lora.targets=[experts.down_proj]", "model.lora.dropout=0.1"],
            "model.lora.dropout: 0.1 with targets experts.down_proj; the experts' adapters",
        ),
        (GPT2, ["model.lora.rank=8"], "model.lora: gpt2's projections are c_attn"),
        (LLAMA, ["checkpoint.init_lora_from=adapter"], "checkpoint.init_lora_from: a LoRA"),
    ],
    ids=[
        "rank",
        "alpha",
        "unknown-target",
        "target-the-model-lacks",
        "expert-target-without-experts",
        "expert-target-dropout",
        "gpt2",
        "adapter-no-lora",
    ],
)
def test_a_bad_lora_setting_exits_2_in_one_line_naming_the_key(config, settings, needle):
    sets = [arg for setting in settings for arg in ("--set", setting)]
    result = invoke_cli("check", "--config", config, *sets)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert needle in line and "Traceback" not in result.stderr
