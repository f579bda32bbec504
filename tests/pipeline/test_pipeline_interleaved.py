"""Interleaved 1F1B (parallel.pp_virtual): at pp = 2 and 4 with 2 model chunks a rank the losses
and grad norms are those of pp = 1 (fp32, LAYOUT_STEPS steps, 1e-5 relative; gpt2 with tied
embeddings and llama, even, uneven and explicit chunk splits, 1F1B and GPipe; DeepSeek-V3's
latent attention, MoE and MTP), and so is the validation loss after them; each rank sends the
bytes the analytic count gives and holds Megatron's count of (micro-batch, chunk) activations;
a pp = 4 checkpoint resumes at pp = 1 on the uninterrupted curve; every pair of ranks posts
matching point-to-point operations in the same order; check shows the chunks and the bubble,
plan divides the bubble by v and counts the warm-up's activations; bad settings are one
line."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatronish.pipeline.schedule import interleaved_ticks, rank_order, warmup_forwards
from tests.conftest import CONFIGS, invoke_cli
from tests.moe.layouts import DEEPSEEK
from tests.parity import (
    GPT2,
    LAYOUT_STEPS,
    LLAMA,
    MTP,
    OVERLAP,
    SAVE_AT,
    SP,
    STEPS,
    assert_check_fails_with_one_line,
    assert_close,
    assert_mtp_close,
    assert_overlap_matches,
    make_config,
    make_trainer,
    reference,
    train_counted,
    train_losses,
)
from tests.ranks import run_on_ranks
from tests.tolerances import FP64_REORDER, LAYOUT_CURVE_REL

pytestmark = pytest.mark.slow  # multi-rank training at every interleaved layout

V2 = ["parallel.pp_virtual=2"]
# 8 layers for 8 chunks; gpt2 in micro-batches of 1, so m = 8 and 1F1B has a steady phase at
# pp = 4; llama at m = 4 = pp, where every rank runs all its forwards first (as Megatron does).
PP4 = ["model.n_layer=8"]
STEADY = ["train.micro_batch_size=1"]
# name -> (tp, dp, pp, overrides); the reference of each is its model and training settings at
# pp = 1.
TWO_RANKS = {
    "gpt2 pp2 v2": (1, 1, 2, GPT2 + V2),
    "llama pp2 v2 layers 2,1,1,1": (
        1, 1, 2, LLAMA + V2 + ["model.n_layer=5", "parallel.pp_layers=2,1,1,1"],
    ),
    "gpt2 pp2 v2 gpipe uneven": (
        1, 1, 2, GPT2 + V2 + ["model.n_layer=5", "parallel.pp_schedule=gpipe"],
    ),
}  # fmt: skip
FOUR_RANKS = {
    "gpt2 pp4 v2 m8": (1, 1, 4, GPT2 + V2 + PP4 + STEADY),
    "llama pp4 v2 m4 mtp": (1, 1, 4, LLAMA + V2 + PP4 + MTP),
    # DeepSeek-V3 (latent attention, its MoE with routing biases, a MoE MTP block) in chunks
    "deepseek dp2 pp2 v2": (1, 2, 2, DEEPSEEK + V2 + ["model.n_layer=4"]),
    "gpt2 tp2 pp2 v2 sp": (2, 1, 2, GPT2 + V2 + SP),
    "gpt2 tp2 pp2 v2 sp overlap": (2, 1, 2, GPT2 + V2 + SP + OVERLAP),
}
SAVED = "gpt2 pp4 v2 m8"  # also saves a checkpoint at step SAVE_AT (of its LAYOUT_STEPS)


def _train_on_ranks(rank, world, variants, dataset, save_dir):
    """For each variant: losses, grad norms, the validation loss after the last step, the
    bytes sent in the first step and the analytic count, and the most activations held."""
    from megatronish.accounting.collectives import formula_bytes_per_step
    from megatronish.training.setup import make_loader

    results = {}
    for name, (tp, dp, pp, overrides) in variants.items():
        extra = []
        if name == SAVED:
            extra = ["checkpoint.save=true", f"checkpoint.dir={save_dir}"]
        trainer = make_trainer(make_config(tp, dp, pp, overrides, dataset, extra), world, dataset)
        mtp: list = []
        save_every = SAVE_AT if name == SAVED else 0
        losses, norms, counter = train_counted(trainer, LAYOUT_STEPS, save_every, mtp)
        held = trainer.pipeline.stats.max_in_flight
        trainer.val_loader = make_loader(trainer.setup, "val")
        d = trainer.setup.derived
        results[name] = {
            "losses": losses,
            "norms": norms,
            "mtp_losses": mtp,
            "val_loss": trainer.evaluate(),
            "sent": counter.total_sent,
            "formula": formula_bytes_per_step(trainer.cfg, d, trainer.ps.pp_rank),
            "held": held,
            "held_expected": _held(trainer.cfg.parallel.pp_schedule, d, trainer.ps.pp_rank),
        }
    return results


def _held(schedule: str, d, pp_rank: int) -> int:
    """Megatron's count: one more than the warm-up forwards (all m v at most)."""
    m, v = d.grad_accum_steps, d.pp_virtual
    return min(warmup_forwards(d.pp, v, m, pp_rank, schedule) + 1, m * v)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interleaved-checkpoints")


@pytest.fixture(scope="module")
def two_ranks(dataset, saved_dir):
    return run_on_ranks(_train_on_ranks, 2, TWO_RANKS, dataset, saved_dir, timeout=300)


@pytest.fixture(scope="module")
def four_ranks(dataset, saved_dir):
    return run_on_ranks(_train_on_ranks, 4, FOUR_RANKS, dataset, saved_dir, timeout=300)


def _model_settings(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(("parallel.", "optim."))]


_FIRST_STEPS: dict = {}


def reference_first_steps(overrides: list[str], dataset: Path) -> dict:
    """The pp = 1 run of these settings over the first LAYOUT_STEPS steps (cached): its losses,
    grad norms, multi-token prediction losses and the validation loss after them."""
    from megatronish.distributed.layout import ParallelState
    from megatronish.training.setup import make_loader

    key = (tuple(overrides), dataset)
    if key not in _FIRST_STEPS:
        cfg = make_config(1, 1, 1, overrides, dataset)
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        mtp: list = []
        losses, norms, _ = train_counted(trainer, LAYOUT_STEPS, mtp_losses=mtp)
        trainer.val_loader = make_loader(trainer.setup, "val")
        val_loss = trainer.evaluate()
        _FIRST_STEPS[key] = dict(losses=losses, norms=norms, mtp_losses=mtp, val_loss=val_loss)
    return _FIRST_STEPS[key]


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_interleaved_losses_grad_norms_and_val_loss_equal_pp1(name, two_ranks, four_ranks, dataset):
    per_rank, variants = (two_ranks, TWO_RANKS) if name in TWO_RANKS else (four_ranks, FOUR_RANKS)
    ref = reference_first_steps(_model_settings(variants[name][3]), dataset)
    val = ref["val_loss"]
    for rank_results in per_rank:
        result = rank_results[name]
        assert_close(result["losses"], ref["losses"], steps=LAYOUT_STEPS)
        assert_close(result["norms"], ref["norms"], steps=LAYOUT_STEPS)
        assert_mtp_close(result, ref, LAYOUT_STEPS)
        assert abs(result["val_loss"] - val) <= LAYOUT_CURVE_REL * val


def test_tp_comm_overlap_at_tp2_pp2_interleaved_equals_it_off_to_1e6(four_ranks):
    assert_overlap_matches(four_ranks, "gpt2 tp2 pp2 v2 sp", LAYOUT_STEPS)


@pytest.mark.parametrize("group", ["two", "four"])
def test_every_rank_sends_the_bytes_the_analytic_count_gives_at_v2(group, two_ranks, four_ranks):
    for rank_results in two_ranks if group == "two" else four_ranks:
        for name, result in rank_results.items():
            assert result["formula"] > 0
            assert result["sent"] == pytest.approx(result["formula"], rel=FP64_REORDER), name


@pytest.mark.parametrize("group", ["two", "four"])
def test_every_rank_holds_megatrons_count_of_micro_batch_chunks(group, two_ranks, four_ranks):
    for rank_results in two_ranks if group == "two" else four_ranks:
        for name, result in rank_results.items():
            assert result["held"] == result["held_expected"], name


def test_a_pp4_v2_checkpoint_resumes_at_pp1_on_the_same_curve(four_ranks, dataset, saved_dir):
    from megatronish.distributed.layout import ParallelState

    overrides = _model_settings(FOUR_RANKS[SAVED][3])
    ref = reference(overrides, dataset)
    cfg = make_config(
        1, 1, 1, overrides, dataset, [f"checkpoint.resume={saved_dir}/step_{SAVE_AT:06d}"]
    )
    trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
    assert trainer.resumed_from == SAVE_AT
    assert_close(train_losses(trainer), ref["losses"][SAVE_AT:], steps=STEPS - SAVE_AT)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("forward_only", [False, True])
def test_every_pair_of_ranks_posts_matching_messages_in_the_same_order(schedule, forward_only):
    for pp, virtual, m in [(2, 2, 2), (2, 2, 8), (2, 3, 6), (3, 2, 6), (4, 2, 8), (4, 3, 4)]:
        ticks = interleaved_ticks(pp, virtual, m, schedule, forward_only)
        for r, rank_ticks in enumerate(ticks):
            ran = [tick.op for tick in rank_ticks if tick.op is not None]
            assert ran == rank_order(pp, virtual, m, r, schedule, forward_only)
        for sender in range(pp):
            for receiver in range(pp):
                sent = [tick.op for tick in ticks[sender] if tick.send == receiver and tick.op]
                received = [
                    key for tick in ticks[receiver] for key, peer in tick.recvs if peer == sender
                ]
                # The key a message is received under is its producer's (micro-batch, chunk)
                # shifted to the consumer's chunk.
                shifted = [(k, i, c + 1 if k == "F" else c - 1) for k, i, c in sent]
                assert received == shifted, (pp, virtual, m, sender, receiver)


def test_cli_check_shows_each_stages_chunks_and_the_interleaved_bubble():
    result = invoke_cli(
        "check", "--config", str(CONFIGS / "tiny.yaml"), "--set", "parallel.pp=2",
        "--set", "parallel.pp_virtual=2", "--set", "model.n_layer=5",
        "--set", "train.global_batch_size=32",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pipeline stages: 2 (layers 3, 2), schedule 1f1b interleaved" in result.stdout
    assert "model chunks by stage (global layers): 0: 0-1, 3; 1: 2, 4" in result.stdout
    assert "bubble (p - 1) / (v x m) = 1 / (2 x 4) = 0.12" in result.stdout


def test_plan_divides_the_bubble_by_v_and_counts_megatrons_warm_up_activations():
    from megatronish.accounting.memory import estimate
    from megatronish.config import load_config

    # gpt2-1.3b on 16 GPUs at tp 1, pp 2: dp 8, m = 8 micro-batches, 12 layers a stage.
    plain = estimate(load_config(CONFIGS / "gpt2-1.3b.yaml"), 16, 1, pp=2)
    cfg = load_config(CONFIGS / "gpt2-1.3b.yaml", ["parallel.pp_virtual=2"])
    interleaved = estimate(cfg, 16, 1, pp=2)
    assert (plain.pp_virtual, interleaved.pp_virtual) == (1, 2)
    assert interleaved.bubble == pytest.approx(plain.bubble / 2) == pytest.approx(1 / 16)
    # The first stage holds 2 (pp - 1) + (v - 1) pp + 1 = 5 (micro-batch, chunk) pairs of 6
    # layers where plain 1F1B holds 2 micro-batches of 12: (1 + (pp - 1) / (pp v)) times.
    assert interleaved.activations_gb == pytest.approx(plain.activations_gb * 1.25)


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["parallel.pp=2", "train.global_batch_size=24"], "parallel.pp_virtual"),  # m = 3
        (["parallel.pp=2", "parallel.pp_virtual=4"], "parallel.pp_virtual"),  # 8 chunks, 4 layers
        (["parallel.pp_virtual=0"], "parallel.pp_virtual"),
        (["parallel.pp=2", "parallel.pp_layers=2,2"], "parallel.pp_layers"),  # needs 4 numbers
    ],
)
def test_cli_bad_interleaved_settings_exit_2_with_one_line(sets, key):
    args = ["--config", str(CONFIGS / "tiny.yaml"), "--set", "parallel.pp_virtual=2"]
    for s in sets:
        args += ["--set", s]
    assert_check_fails_with_one_line(args, key)
