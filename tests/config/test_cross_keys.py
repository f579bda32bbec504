"""Keys that only mean something beside another key's value: an fp8 key set under another
precision is one line, exit 2, as a model.mla size without model.attention mla is."""

from __future__ import annotations

import pytest

from tests.conftest import CONFIGS, invoke_cli


def _check(config: str, *sets: str):
    return invoke_cli(
        "check", "--config", str(CONFIGS / config), *(a for s in sets for a in ("--set", s))
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("key", "value", "default"),
    [("fp8_recipe", "blockwise", "tensorwise"), ("fp8_high_precision", "fp32", "bf16")],
)
def test_an_fp8_key_set_under_another_precision_exits_2_naming_both_keys(
    precision, key, value, default
):
    result = _check("tiny.yaml", f"train.precision={precision}", f"train.{key}={value}")
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"train.{key}: {value} needs train.precision=fp8" in lines[0]
    assert f"train.precision is {precision}" in lines[0]
    assert f"valid with {precision}: {default}" in lines[0]


def test_fp8_keys_left_at_their_defaults_or_under_fp8_pass_check():
    assert _check("tiny.yaml", "train.precision=bf16").returncode == 0
    blockwise = _check("tiny.yaml", "train.precision=fp8", "train.fp8_recipe=blockwise")
    assert blockwise.returncode == 0, blockwise.stderr
