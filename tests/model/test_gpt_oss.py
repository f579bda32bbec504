"""GPT-OSS's settings: a bad one is exit 2 in one line naming the key (the components against
transformers: tests/hf/test_hf_gpt_oss.py)."""

from __future__ import annotations

import pytest

from tests.conftest import CONFIGS, invoke_cli

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
