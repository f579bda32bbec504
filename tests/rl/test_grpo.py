"""The built-in GRPO run (`megatronish rl --config configs/tiny-rl.yaml`), short: it logs a
reward in [0, 1] and the step's metrics at every step; at tp 2 on two ranks (as `launch
--command rl` starts it) it samples the same rollouts as in one process; its advantages are
group-normalized; a bad rl.* setting is a user error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronish.commands.launch import torchrun_args
from tests.conftest import CONFIGS, invoke_cli
from tests.ranks import run_cli_on_ranks
from tests.tolerances import FP64_REORDER, LAYOUT_CURVE_REL

SHORT = [
    "train.steps=2",
    "rl.sft_steps=1",
    "rl.prompts_per_step=2",
    "rl.num_generations=2",
]
CONFIG = str(CONFIGS / "tiny-rl.yaml")


def _sets(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> list[dict]:
    """The short run in this process (tp 1): its metrics."""
    out = tmp_path_factory.mktemp("tp1")
    result = invoke_cli("rl", "--config", CONFIG, *_sets([*SHORT, f"run.out_dir={out}"]))
    assert result.returncode == 0, result.stderr
    return _records(out)


def test_the_short_built_in_rl_run_logs_a_reward_in_0_1_and_its_metrics_every_step(short_run):
    assert [record["step"] for record in short_run] == [1, 2]
    for record in short_run:
        assert 0.0 <= record["reward"] <= 1.0
        assert {"loss", "clip_fraction", "kl", "entropy", "grad_norm"} <= set(record)


def test_rl_at_tp2_on_two_ranks_samples_the_one_process_runs_rollouts(short_run, tmp_path):
    """The policy at tp 2, refit every step into rank 0's tp 1 engine, whose rollouts every
    rank takes: the same rewards as in one process, and the same entropies of them."""
    sets = _sets([*SHORT, "train.steps=1", "parallel.tp=2", f"run.out_dir={tmp_path}"])
    ranks = run_cli_on_ranks(["rl", "--config", CONFIG, *sets], 2)
    assert [rank.returncode for rank in ranks] == [0, 0], ranks[0].stderr + ranks[1].stderr
    (ours,) = _records(tmp_path)  # its first step: the one-process run's first (lr constant)
    one = short_run[0]
    assert ours["step"] == 1 and ours["reward"] == one["reward"]
    assert ours["entropy"] == pytest.approx(one["entropy"], rel=LAYOUT_CURVE_REL)


def test_launch_command_rl_has_torchrun_start_megatronish_rl_on_the_ranks():
    args = torchrun_args(CONFIG, ("parallel.tp=2",), 2, 0, 1, 0, "", 600, False, "rl")
    assert args[args.index("-m") :] == [
        "-m", "megatronish", "rl", "--config", CONFIG, "--set", "parallel.tp=2",
    ]  # fmt: skip


def test_group_advantages_are_the_rewards_less_the_group_mean_over_its_std():
    from megatronish.rl.grpo import GROUP_STD_EPS, group_advantages

    got = group_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], 3)
    std = (1 / 3) ** 0.5  # the unbiased std of (1, 0, 0) and of (0, 1, 1)
    want = [x / (std + GROUP_STD_EPS) for x in (2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3)]
    assert got == pytest.approx(want, rel=FP64_REORDER)


@pytest.mark.parametrize("launched", [False, True])
@pytest.mark.parametrize("setting", ["rl.num_generations=1", "rl.sft_lr=0"])
def test_a_bad_rl_setting_is_a_user_error_naming_it(setting, launched, tmp_path):
    """In one process, and from `launch --command rl` before any rank starts."""
    sets = _sets([setting, f"run.out_dir={tmp_path}"])
    command = ["launch", "--command", "rl"] if launched else ["rl"]
    result = invoke_cli(*command, "--config", CONFIG, *sets)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and setting.replace("=", ": ") in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
