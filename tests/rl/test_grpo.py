"""The built-in GRPO run (`megatronish rl --config configs/tiny-rl.yaml`), short: it logs a
reward in [0, 1] and the step's metrics at every step; its advantages are group-normalized; a
bad rl.* setting is a user error naming it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import CONFIGS, invoke_cli
from tests.tolerances import FP64_REORDER

SHORT = [
    "train.steps=2",
    "rl.sft_steps=1",
    "rl.prompts_per_step=2",
    "rl.num_generations=2",
]


def _sets(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def test_the_short_built_in_rl_run_logs_a_reward_in_0_1_and_its_metrics_every_step(tmp_path):
    config = str(CONFIGS / "tiny-rl.yaml")
    result = invoke_cli("rl", "--config", config, *_sets([*SHORT, f"run.out_dir={tmp_path}"]))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    for record in records:
        assert 0.0 <= record["reward"] <= 1.0
        assert {"loss", "clip_fraction", "kl", "entropy", "grad_norm"} <= set(record)


def test_group_advantages_are_the_rewards_less_the_group_mean_over_its_std():
    from megatronish.rl.grpo import GROUP_STD_EPS, group_advantages

    got = group_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], 3)
    std = (1 / 3) ** 0.5  # the unbiased std of (1, 0, 0) and of (0, 1, 1)
    want = [x / (std + GROUP_STD_EPS) for x in (2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3)]
    assert got == pytest.approx(want, rel=FP64_REORDER)


def test_a_bad_rl_setting_is_a_user_error_naming_it(tmp_path):
    config = str(CONFIGS / "tiny-rl.yaml")
    sets = _sets(["rl.num_generations=1", f"run.out_dir={tmp_path}"])
    result = invoke_cli("rl", "--config", config, *sets)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "rl.num_generations: 1" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
