"""Keys that only mean something beside another key's value: an fp8 key set under another
precision is one line, exit 2, as a model.mla size without model.attention mla is; and the
values a message suggests for a key (valid tp, ep, n_group) each pass every check."""

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


SUGGESTING = [  # (config, --set values, the key whose values the line suggests, those values)
    ("tiny.yaml", ["train.precision=fp8", "train.fp8_recipe=blockwise", "parallel.tp=2"],
     "parallel.tp", "valid tp: 1, or another fp8_recipe"),
    ("tiny.yaml", ["parallel.tp=3"], "parallel.tp", "valid tp: 1, 2, 4"),
    ("tiny.yaml", ["model.arch=llama", "model.n_kv_head=2", "parallel.tp=4"], "parallel.tp",
     "valid tp: 1, 2"),
    ("tiny-moe.yaml", ["parallel.ep=3", "parallel.dp=6", "train.global_batch_size=48"],
     "parallel.ep", "valid ep: 1, 2"),
    ("tiny-deepseek-v3.yaml", ["model.moe.n_group=8"], "model.moe.n_group", "valid: 2, 4"),
    ("tiny-deepseek-v3.yaml", ["model.moe.n_group=3"], "model.moe.n_group", "valid: 2, 4"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "sets", "key", "valid"), SUGGESTING)
def test_every_value_a_message_suggests_passes_every_check(config, sets, key, valid):
    result = _check(config, *sets)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].endswith(valid), lines[0]
    values = valid.split(": ")[1].split(", or ")[0].split(", ")
    for value in values:
        fixed = _check(config, *sets, f"{key}={value}")
        assert fixed.returncode == 0, (value, fixed.stderr)


def test_when_no_value_passes_every_check_the_message_says_why_the_simplest_fails():
    result = _check("tiny.yaml", "model.n_head=3", "parallel.tp=2")
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == (
        "error: model.n_head: 3 is not divisible by parallel.tp=2; valid tp: none (at "
        "parallel.tp=1: model.d_model: 128 is not divisible by model.n_head=3)"
    )
