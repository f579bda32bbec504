"""Phase times, stragglers, memory and TensorBoard: on a tp2 x pp2 run every logged step has
every phase field, each rank's phases add up to its step time, and a rank slowed down in its
forward is named as the straggler (from wait times) and no other rank is; TensorBoard's event
files hold metrics.jsonl's values; a missing tensorboard package is one line."""

from __future__ import annotations

import json
import time

import pytest

from megatronish.observe.phases import FIELDS, PHASES
from tests.parity import GPT2, make_config, make_trainer
from tests.ranks import run_on_ranks
from tests.tolerances import FP32_STORED_REL, TRACE_PARTS_REL

pytestmark = pytest.mark.slow  # multi-rank runs with a slowed rank

SLOW_RANK, SLOW_S = 3, 0.02
STEPS = 6


def _slow_run(rank, world, dataset, out_dir):
    from megatronish.training import trainer as trainer_module

    cfg = make_config(
        2, 1, 2, GPT2, dataset,
        [f"train.steps={STEPS}", "train.log_every=1", f"run.out_dir={out_dir}"],
    )  # fmt: skip
    trainer = make_trainer(cfg, world, dataset)
    if rank == SLOW_RANK:  # a test hook: this rank's forward takes SLOW_S longer
        forward = trainer.model.stage_forward

        def slow_forward(*args):
            time.sleep(SLOW_S)
            return forward(*args)

        trainer.model.stage_forward = slow_forward
    rows = []
    gather = trainer_module.gather_rows

    def recording_gather(*args):
        rows.append(gather(*args))
        return rows[-1]

    trainer_module.gather_rows = recording_gather
    try:
        trainer.run()
    finally:
        trainer_module.gather_rows = gather
    return rows


@pytest.fixture(scope="module")
def slow_run(dataset, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("phases")
    per_rank = run_on_ranks(_slow_run, 4, dataset, out_dir, timeout=180)
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return per_rank[0], [line for line in lines if "loss" in line]


def test_every_logged_step_has_every_phase_field_over_the_ranks(slow_run):
    _, lines = slow_run
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:
        for name in FIELDS:
            key = name if name.startswith("peak") else f"{name}_s"
            stats = line["phases"][key]
            assert stats["min"] <= stats["median"] <= stats["max"]
            assert 0 <= stats["max_rank"] < 4
        assert line["peak_memory_gb"] > 0 and 0 <= line["peak_memory_rank"] < 4
        assert line["phases"]["bubble_s"]["max"] > 0  # pp waits are counted


def test_the_phases_of_each_rank_add_up_to_its_step_time(slow_run):
    rows_per_step, _ = slow_run
    for rows in rows_per_step:
        for row in rows:
            fields = dict(zip(FIELDS, row))
            total = sum(fields[p] for p in PHASES)
            assert abs(total - fields["step"]) <= TRACE_PARTS_REL * fields["step"], fields
            waits = sum(v for k, v in fields.items() if k.startswith("wait_"))
            assert waits <= fields["step"] and fields["compute"] > 0


def test_the_slowed_rank_is_named_as_the_straggler_and_no_other(slow_run):
    _, lines = slow_run
    named = [line["straggler"] for line in lines]
    # The first logged step pays start-up costs unevenly and is not judged.
    assert named == [None] + [SLOW_RANK] * (STEPS - 1), named


def test_tensorboard_event_files_hold_the_metrics_values(tmp_path, dataset):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatronish.distributed.layout import ParallelState

    cfg = make_config(
        1, 1, 1, GPT2, dataset,
        ["train.steps=4", "train.log_every=1", f"run.out_dir={tmp_path / 'run'}",
         "observe.tensorboard=true"],
    )  # fmt: skip
    trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
    trainer.run()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert losses == [
        (line["step"], pytest.approx(line["loss"], rel=FP32_STORED_REL)) for line in lines
    ]
    assert "phases/forward_s/max" in events.Tags()["scalars"]
    assert "peak_memory_gb" in events.Tags()["scalars"]


def test_tensorboard_without_the_package_exits_2_with_one_line(monkeypatch):
    import importlib.util

    from tests.conftest import CONFIGS, invoke_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    result = invoke_cli(
        "check", "--config", str(CONFIGS / "tiny.yaml"), "--set", "observe.tensorboard=true"
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "observe.tensorboard" in lines[0] and "pip install" in lines[0]
