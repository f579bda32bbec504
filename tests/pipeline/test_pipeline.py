"""Pipeline parallelism: every layout with pp > 1 trains the same losses as pp = 1 (fp32, the
reference's first LAYOUT_STEPS steps, 1e-5 relative) under both schedules; 1F1B holds at most
pp micro-batches of activations per stage and GPipe all of them (measured); each stage sends
the bytes the analytic count says; checkpoints saved at pp = 2 resume at pp = 1 (tp 1 and
tp 2) on the uninterrupted curve and load, evaluate and export as pp = 1 checkpoints do; config
errors are one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS, invoke_cli
from tests.parity import (
    GPT2,
    LAYOUT_STEPS,
    LLAMA,
    MTP,
    MTP2,
    OVERLAP,
    SAVE_AT,
    SP,
    STEPS,
    assert_check_fails_with_one_line,
    assert_close,
    assert_curves_match,
    assert_overlap_matches,
    make_config,
    make_trainer,
    reference,
    run_reference,
    train_counted,
    train_losses,
)
from tests.ranks import run_on_ranks
from tests.tolerances import FP64_REORDER, PARITY_ABS, PARITY_REL, PRINTED_HUNDREDTHS_ABS

pytestmark = pytest.mark.slow  # multi-rank training at every pipeline layout

# name -> (tp, dp, pp, overrides); the reference of each is the same overrides at pp = 1 alone.
TWO_RANKS = {
    "gpt2 pp2 1f1b": (1, 1, 2, GPT2 + ["parallel.pp_schedule=1f1b"]),
    "gpt2 pp2 gpipe": (1, 1, 2, GPT2 + ["parallel.pp_schedule=gpipe"]),
    "llama pp2 1f1b uneven 3,1": (1, 1, 2, LLAMA + ["parallel.pp_layers=3,1"]),
    "llama pp2 gpipe full recompute mtp2": (
        1, 1, 2,
        LLAMA + MTP2 + ["parallel.pp_schedule=gpipe", "train.activation_checkpointing=full"],
    ),
}  # fmt: skip
FOUR_RANKS = {
    "gpt2 tp2 pp2 1f1b sp": (2, 1, 2, GPT2 + SP),
    "gpt2 tp2 pp2 gpipe": (2, 1, 2, GPT2 + ["parallel.pp_schedule=gpipe"]),
    "llama tp2 pp2 1f1b sp": (2, 1, 2, LLAMA + SP),
    "llama tp2 pp2 1f1b sp mtp": (2, 1, 2, LLAMA + SP + MTP),
    "llama tp2 pp2 1f1b sp overlap": (2, 1, 2, LLAMA + SP + OVERLAP),
    "llama tp2 pp2 gpipe sp": (2, 1, 2, LLAMA + SP + ["parallel.pp_schedule=gpipe"]),
    "gpt2 dp2 pp2 zero1 mtp": (1, 2, 2, GPT2 + MTP + ["optim.zero=1"]),
    "llama pp4 uneven": (1, 1, 4, LLAMA + ["model.n_layer=5"]),
}
# variants that train all STEPS steps and save checkpoints at steps SAVE_AT and STEPS, into this
# folder of saved_dir: the loaded and exported one, and the resumed one (with the multi-token
# prediction module, on the last stage, and the embedding copy it keeps there)
SAVED = {"gpt2 tp2 pp2 1f1b sp": "loaded", "llama tp2 pp2 1f1b sp mtp": "resumed"}


def steps_of(name: str) -> int:
    """The steps a variant trains: all of the reference's when it saves, else LAYOUT_STEPS."""
    return STEPS if name in SAVED else LAYOUT_STEPS


def _train_on_ranks(rank, world, variants, dataset, save_dir):
    """For each variant: its losses and grad norms, and each stage's schedule statistics."""
    from megatronish.accounting.collectives import formula_bytes_per_step

    results = {}
    for name, (tp, dp, pp, overrides) in variants.items():
        extra = []
        if name in SAVED:
            folder = save_dir / SAVED[name]
            extra = ["checkpoint.save=true", "checkpoint.every=10", f"checkpoint.dir={folder}"]
        cfg = make_config(tp, dp, pp, overrides, dataset, extra)
        trainer = make_trainer(cfg, world, dataset)
        mtp: list = []
        save_every = SAVE_AT if name in SAVED else 0
        losses, norms, counter = train_counted(trainer, steps_of(name), save_every, mtp)
        counted = counter.total_sent
        ps = trainer.ps
        results[name] = {
            "losses": losses,
            "norms": norms,
            "mtp_losses": mtp,
            "pp_rank": ps.pp_rank,
            "sent": counted,
            "formula": formula_bytes_per_step(cfg, trainer.setup.derived, ps.pp_rank),
        }
    return results


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pp-checkpoints")


@pytest.fixture(scope="module")
def two_ranks(dataset, saved_dir):
    return run_on_ranks(_train_on_ranks, 2, TWO_RANKS, dataset, saved_dir, timeout=300)


@pytest.fixture(scope="module")
def four_ranks(dataset, saved_dir):
    return run_on_ranks(_train_on_ranks, 4, FOUR_RANKS, dataset, saved_dir, timeout=300)


def reference_overrides(name: str, variants: dict) -> list[str]:
    """The variant's model and training settings without its parallel ones and recompute, which
    changes nothing in one process."""
    overrides = variants[name][3]
    return [o for o in overrides if not o.startswith(("parallel.", "train.activation"))]


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_pp2_losses_and_grad_norms_equal_pp1(name, two_ranks, dataset):
    ref = reference(reference_overrides(name, TWO_RANKS), dataset)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # the runs really learn
    assert_curves_match(two_ranks, name, ref, steps_of(name))


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_tp_dp_pp_layouts_losses_and_grad_norms_equal_pp1(name, four_ranks, dataset):
    ref = reference(reference_overrides(name, FOUR_RANKS), dataset)
    assert_curves_match(four_ranks, name, ref, steps_of(name))


def test_tp_comm_overlap_at_tp2_pp2_1f1b_equals_it_off_to_1e6(four_ranks):
    assert_overlap_matches(four_ranks, "llama tp2 pp2 1f1b sp", LAYOUT_STEPS)


@pytest.mark.parametrize("group", ["two", "four"])
def test_every_stage_sends_the_bytes_the_analytic_count_gives(group, two_ranks, four_ranks):
    per_rank = two_ranks if group == "two" else four_ranks
    for rank_results in per_rank:
        for name, result in rank_results.items():
            assert result["formula"] > 0
            assert result["sent"] == pytest.approx(result["formula"], rel=FP64_REORDER), name


def _schedule_memory(rank, world, dataset, micro_batches):
    """Per schedule: (max micro-batches in flight, peak saved-tensor bytes) on this stage."""
    from megatronish.distributed.layout import ParallelState
    from megatronish.pipeline.runner import Pipeline

    out = {}
    ps = ParallelState.from_world(1, 1, world)
    for schedule in ("1f1b", "gpipe"):
        cfg = make_config(
            1, 1, world, GPT2, dataset,
            [f"train.global_batch_size={2 * micro_batches}", f"parallel.pp_schedule={schedule}"],
        )  # fmt: skip
        trainer = make_trainer(cfg, world, dataset, ps)
        trainer.pipeline = Pipeline(trainer.model, ps, schedule, measure_memory=True)
        trainer.train_step()
        stats = trainer.pipeline.stats
        out[schedule] = (stats.max_in_flight, stats.peak_saved_bytes)
    return out


def test_1f1b_holds_at_most_pp_micro_batches_of_activations_gpipe_holds_all(dataset):
    m = 6  # more than the 4 stages: GPipe holds all 6 on every stage, 1F1B 4 down to 1
    per_rank = run_on_ranks(_schedule_memory, 4, dataset, m, timeout=180)
    for pp_rank, result in enumerate(per_rank):
        in_flight_1f1b, bytes_1f1b = result["1f1b"]
        in_flight_gpipe, bytes_gpipe = result["gpipe"]
        assert in_flight_1f1b == 4 - pp_rank <= 4
        assert in_flight_gpipe == m
        # Saved activations scale with the micro-batches held (within one micro-batch's worth).
        per_micro = bytes_gpipe / m
        assert bytes_1f1b <= in_flight_1f1b * per_micro * 1.01
        assert bytes_1f1b >= (in_flight_1f1b - 1) * per_micro


def _resume_tp2(rank, world, dataset, checkpoint_dir):
    cfg = make_config(
        2, 1, 1, LLAMA + MTP + SP, dataset,
        [f"checkpoint.resume={checkpoint_dir}/step_{SAVE_AT:06d}", "checkpoint.save=false"],
    )  # fmt: skip
    trainer = make_trainer(cfg, world, dataset)
    assert trainer.resumed_from == SAVE_AT
    return train_losses(trainer)


def test_a_pp2_checkpoint_resumes_at_pp1_on_tp1_and_tp2_on_the_same_curve(
    four_ranks, dataset, saved_dir
):
    from megatronish.distributed.layout import ParallelState

    ref = reference(LLAMA + MTP, dataset)
    resume = f"checkpoint.resume={saved_dir}/resumed/step_{SAVE_AT:06d}"
    cfg = make_config(1, 1, 1, LLAMA + MTP, dataset, [resume])
    trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
    assert trainer.resumed_from == SAVE_AT
    assert_close(train_losses(trainer), ref["losses"][SAVE_AT:], steps=STEPS - SAVE_AT)
    for tp2 in run_on_ranks(_resume_tp2, 2, dataset, saved_dir / "resumed", timeout=180):
        assert_close(tp2, ref["losses"][SAVE_AT:], steps=STEPS - SAVE_AT)


def test_a_pp2_checkpoint_loads_evaluates_and_exports_like_pp1(
    four_ranks, dataset, saved_dir, tmp_path
):
    from safetensors.torch import load_file

    from megatronish import load_model
    from megatronish.checkpoint.reader import Checkpoint
    from megatronish.hf.exporter import export_hf

    ckpt = Checkpoint(saved_dir / "loaded" / f"step_{STEPS:06d}")
    assert ckpt.pp == 2 and ckpt.tp == 2
    # The pp = 1 run's weights at step 20, saved through the same code.
    ref = run_reference(GPT2, dataset, **{"checkpoint.dir": tmp_path / "ref"})
    ref["trainer"].save_checkpoint()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = load_model(saved_dir / "loaded" / f"step_{STEPS:06d}")(tokens)
        want = load_model(tmp_path / "ref" / f"step_{STEPS:06d}")(tokens)
    torch.testing.assert_close(got, want, rtol=PARITY_REL, atol=PARITY_ABS)
    export_hf(str(saved_dir / "loaded" / f"step_{STEPS:06d}"), str(tmp_path / "hf_pp"))
    export_hf(str(tmp_path / "ref" / f"step_{STEPS:06d}"), str(tmp_path / "hf_ref"))
    got_hf = load_file(str(tmp_path / "hf_pp" / "model.safetensors"))
    want_hf = load_file(str(tmp_path / "hf_ref" / "model.safetensors"))
    assert got_hf.keys() == want_hf.keys()
    for key in want_hf:
        torch.testing.assert_close(got_hf[key], want_hf[key], rtol=PARITY_REL, atol=PARITY_ABS)
    result = invoke_cli("eval", "--checkpoint", str(saved_dir / "loaded" / f"step_{STEPS:06d}"))
    assert result.returncode == 0, result.stderr
    ref_eval = invoke_cli("eval", "--checkpoint", str(tmp_path / "ref" / f"step_{STEPS:06d}"))
    assert result.stdout.splitlines()[0] == ref_eval.stdout.splitlines()[0]


def test_cli_check_and_plan_show_the_stages_and_the_bubble():
    result = invoke_cli(
        "check", "--config", str(CONFIGS / "tiny.yaml"), "--set", "parallel.pp=3",
        "--set", "model.n_layer=5", "--set", "train.micro_batch_size=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pipeline stages: 3 (layers 2, 2, 1)" in result.stdout
    assert "bubble (p - 1) / m = 2 / 8 = 0.25" in result.stdout
    plan = invoke_cli(
        "plan", "--config", str(CONFIGS / "gpt2-1.3b.yaml"), "--gpus", "16", "--gpu", "A10G",
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    assert lines[2].split()[:5] == ["tp", "cp", "dp", "pp", "bubble"]
    table = lines[3 : lines.index("", 3)]  # the memory table, before the fastest layouts
    rows = [line.split() for line in table if line.strip()[:1].isdigit()]
    by_pp = {int(row[3]): float(row[4]) for row in rows if row[:2] == ["1", "1"]}
    # gpt2-1.3b: global batch 512 of micro-batches 8; tp 1 x pp 2 on 16 GPUs: dp 8, m = 8.
    assert by_pp[1] == 0.0 and by_pp[2] == pytest.approx(1 / 8, abs=PRINTED_HUNDREDTHS_ABS)


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["parallel.pp=2", "parallel.pp_layers=3,2"], "parallel.pp_layers"),
        (["parallel.pp=2", "parallel.pp_layers=a,b"], "parallel.pp_layers"),
        (["parallel.pp=8"], "parallel.pp"),
        (["parallel.pp_schedule=zigzag"], "parallel.pp_schedule"),
    ],
)
def test_cli_bad_pipeline_settings_exit_2_with_one_line(sets, key):
    args = ["--config", str(CONFIGS / "tiny.yaml")]
    for s in sets:
        args += ["--set", s]
    assert_check_fails_with_one_line(args, key)
