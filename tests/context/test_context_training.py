"""Context parallelism in training: at cp = 2 and 4, alone and with tp (and sequence
parallelism), pp, dp and ZeRO-1, gpt2 and llama (GQA; yarn RoPE scaling and a sliding window
shorter than the sequence after the first block, whose ring skips the blocks outside it), the
first LAYOUT_STEPS fp32 steps give the losses and gradient norms of cp = 1's run within 1e-5
relative (the loss is the mean over every token whatever cp is, so neither it nor the gradients
scale with cp); each rank sends the ring bytes the analytic count gives; checkpoints move
between cp = 2 and cp = 1 on the uninterrupted curve; bad cp settings are one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CONFIGS, invoke_cli
from tests.parity import (
    LAYOUT_STEPS,
    MTP2,
    OVERLAP,
    SAVE_AT,
    SP,
    STEPS,
    assert_check_fails_with_one_line,
    assert_close,
    assert_curves_match,
    assert_overlap_matches,
    make_trainer,
    train_counted,
    train_losses,
)
from tests.parity import make_config as parity_config
from tests.ranks import run_on_ranks
from tests.tolerances import FP32_FEW_OPS_REL, FP32_GRAD_ABS, FP32_REORDER

pytestmark = pytest.mark.slow  # multi-rank training at every cp layout

# Two layers and two micro-batches of 4 a step: each ring step costs a wait on every cp rank.
GPT2 = ["model.arch=gpt2", "model.n_layer=2", "train.micro_batch_size=4"]
LLAMA = ["model.arch=llama", "model.n_kv_head=2", "model.n_layer=2", "train.micro_batch_size=4"]
# RoPE scaled for a context of 4 x 16 (at head dim 12: dim pair 0 kept, the others slowed, cos
# and sin times 1.14): each cp rank rotates by its zigzag chunks' global positions.
YARN = "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 16}"
# Heads of 12, YaRN, and a window of 5 of the 16 positions in block 1 (block 0 attends fully):
# of the 4-token chunks at cp 2 the ring skips those 8 or more positions before a rank's
# queries, and pp 2 puts block 1 on the second stage. Both variants share one reference.
HEAD_DIM_12_WINDOW = [
    "model.head_dim=12",
    "model.sliding_window=5",
    "model.full_attention_layers=1",
    YARN,
]
# Multi-head latent attention (DeepSeek-V3): the ring carries keys of 8 + 4 and values of 6 per
# head, and under full recompute the rerun gathers its latents again; YaRN as above.
MLA = [
    "model.arch=deepseek_v3", "model.n_layer=2", "train.micro_batch_size=4",
    "model.mla.q_lora_rank=12", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
    "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6",
    "model.rope_scaling.original_max_position_embeddings=16",
]  # fmt: skip

DOCUMENTS = ["data.document_mask=true", "data.eod_mask_loss=true"]

# name -> (tp, cp, dp, pp, overrides); the reference of each is its overrides at one rank.
TWO_RANKS = {
    "gpt2 cp2": (1, 2, 1, 1, GPT2),
    "llama cp2 gqa": (1, 2, 1, 1, LLAMA),
    # multi-token prediction: the tokens ahead of each zigzag chunk come from the next chunk,
    # another rank's; with document masks and the end-of-document targets left out of the loss
    "llama cp2 selective recompute mtp2 documents": (
        1, 2, 1, 1,
        LLAMA + MTP2 + ["train.activation_checkpointing=selective", *DOCUMENTS],
    ),
}  # fmt: skip
FOUR_RANKS = {
    "gpt2 cp4": (1, 4, 1, 1, GPT2),
    "llama cp4 gqa": (1, 4, 1, 1, LLAMA),
    "gpt2 tp2 cp2 sp": (2, 2, 1, 1, GPT2 + SP),
    "llama tp2 cp2": (2, 2, 1, 1, LLAMA),
    "llama tp2 cp2 sp head_dim 12 window yarn": (2, 2, 1, 1, LLAMA + SP + HEAD_DIM_12_WINDOW),
    "llama tp2 cp2 overlap": (2, 2, 1, 1, LLAMA + OVERLAP),
    "gpt2 cp2 pp2 full recompute": (1, 2, 1, 2, GPT2 + ["train.activation_checkpointing=full"]),
    "llama cp2 pp2 head_dim 12 window yarn": (1, 2, 1, 2, LLAMA + HEAD_DIM_12_WINDOW),
    "gpt2 cp2 dp2 zero1": (1, 2, 2, 1, GPT2 + ["optim.zero=1"]),
    "llama cp2 dp2": (1, 2, 2, 1, LLAMA),
    "mla tp2 cp2 sp full recompute mtp1": (
        2, 2, 1, 1, MLA + SP + ["train.activation_checkpointing=full", "model.mtp_depth=1"],
    ),
}  # fmt: skip
SAVED = "gpt2 cp2"  # also saves a checkpoint at step SAVE_AT (of its LAYOUT_STEPS)


def make_config(tp, cp, dp, pp, overrides, dataset, extra=()):
    """The parity config (tests/parity.py) at this layout, in the variants' order."""
    return parity_config(tp, dp, pp, overrides, dataset, extra, cp=cp)


def _train_on_ranks(rank, world, variants, dataset, save_dir):
    """For each variant: losses, grad norms, and the ring bytes sent in its first step."""
    from megatronish.accounting.collectives import formula_payload_by_kind

    results = {}
    for name, (tp, cp, dp, pp, overrides) in variants.items():
        extra = []
        if name == SAVED:
            extra = ["checkpoint.save=true", f"checkpoint.dir={save_dir}"]
        cfg = make_config(tp, cp, dp, pp, overrides, dataset, extra)
        trainer = make_trainer(cfg, world, dataset)
        mtp: list = []
        save_every = SAVE_AT if name == SAVED else 0
        losses, norms, counter = train_counted(trainer, LAYOUT_STEPS, save_every, mtp)
        formula = formula_payload_by_kind(cfg, trainer.setup.derived, trainer.ps.pp_rank)
        results[name] = {
            "losses": losses,
            "norms": norms,
            "mtp_losses": mtp,
            "payload": dict(counter.payload_bytes),
            "formula": formula,
        }
    return results


_REFERENCES: dict = {}


def reference(overrides: list[str], dataset: Path, save_dir: Path | None = None) -> dict:
    """The one-rank run of these model settings (cached); saves step SAVE_AT into save_dir."""
    from megatronish.distributed.layout import ParallelState

    key = (tuple(o for o in overrides if not o.startswith("optim.")), dataset)
    if key not in _REFERENCES:
        extra = [f"checkpoint.save={save_dir is not None}"]
        if save_dir is not None:
            extra.append(f"checkpoint.dir={save_dir}")
        cfg = make_config(1, 1, 1, 1, list(key[0]), dataset, extra)
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        mtp: list = []
        losses, norms, _ = train_counted(
            trainer, STEPS, SAVE_AT if save_dir is not None else 0, mtp
        )
        _REFERENCES[key] = {"losses": losses, "norms": norms, "mtp_losses": mtp}
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory) -> dict[str, Path]:
    return {"cp2": tmp_path_factory.mktemp("cp2-ckpt"), "cp1": tmp_path_factory.mktemp("cp1-ckpt")}


@pytest.fixture(scope="module")
def two_ranks(dataset, saved_dirs):
    return run_on_ranks(_train_on_ranks, 2, TWO_RANKS, dataset, saved_dirs["cp2"], timeout=300)


@pytest.fixture(scope="module")
def four_ranks(dataset, saved_dirs):
    return run_on_ranks(_train_on_ranks, 4, FOUR_RANKS, dataset, saved_dirs["cp2"], timeout=300)


def model_overrides(variant) -> list[str]:
    return [o for o in variant[4] if not o.startswith(("parallel.", "train.activation"))]


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_cp2_losses_and_grad_norms_equal_cp1(name, two_ranks, dataset):
    ref = reference(model_overrides(TWO_RANKS[name]), dataset)
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # the runs really learn
    assert_curves_match(two_ranks, name, ref, LAYOUT_STEPS)


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_cp_with_tp_pp_dp_zero_losses_and_grad_norms_equal_cp1(name, four_ranks, dataset):
    ref = reference(model_overrides(FOUR_RANKS[name]), dataset)
    assert_curves_match(four_ranks, name, ref, LAYOUT_STEPS)


@pytest.mark.parametrize("group", ["two", "four"])
def test_every_rank_sends_the_ring_bytes_the_analytic_count_gives(group, two_ranks, four_ranks):
    for rank_results in two_ranks if group == "two" else four_ranks:
        for name, result in rank_results.items():
            assert result["payload"]["cp_ring"] > 0, name
            assert result["payload"] == result["formula"], name


def test_tp_comm_overlap_without_sequence_parallelism_at_tp2_cp2_equals_it_off_to_1e6(
    four_ranks,
):
    assert_overlap_matches(four_ranks, "llama tp2 cp2", LAYOUT_STEPS)


def _resume(rank, world, dataset, step_dir, cp):
    cfg = make_config(
        1, cp, 1, 1, GPT2, dataset, [f"checkpoint.resume={step_dir}", "checkpoint.save=false"]
    )
    trainer = make_trainer(cfg, world, dataset)
    assert trainer.resumed_from == SAVE_AT
    return train_losses(trainer)


def test_a_cp2_checkpoint_resumes_at_cp1_and_a_cp1_checkpoint_at_cp2_on_the_same_curve(
    two_ranks, dataset, saved_dirs
):
    from megatronish.distributed.layout import ParallelState

    _REFERENCES.pop((tuple(GPT2), dataset), None)  # rerun, saving step SAVE_AT at cp = 1
    ref = reference(GPT2, dataset, saved_dirs["cp1"])
    cp1 = make_config(
        1, 1, 1, 1, GPT2, dataset,
        [f"checkpoint.resume={saved_dirs['cp2']}/step_{SAVE_AT:06d}", "checkpoint.save=false"],
    )  # fmt: skip
    trainer = make_trainer(cp1, 1, dataset, ParallelState.single())
    assert trainer.resumed_from == SAVE_AT
    assert_close(train_losses(trainer), ref["losses"][SAVE_AT:], steps=STEPS - SAVE_AT)
    step_dir = saved_dirs["cp1"] / f"step_{SAVE_AT:06d}"
    for losses in run_on_ranks(_resume, 2, dataset, step_dir, 2, timeout=120):
        assert_close(losses, ref["losses"][SAVE_AT:], steps=STEPS - SAVE_AT)


@pytest.mark.parametrize(
    ("world", "sets", "key"),
    [
        (3, ["parallel.cp=3"], "train.seq_len"),
        (4, ["parallel.cp=3"], "world size"),
        (4, ["parallel.cp=2", "parallel.dp=3"], "world size"),
        (4, ["parallel.cp=0"], "parallel.cp"),
        (4, ["parallel.cp=2", "model.dropout=0.1"], "model.dropout"),
        (6, ["parallel.cp=2", "parallel.tp=3", "model.n_head=3", "model.d_model=96",
             "parallel.sequence_parallel=true", "train.seq_len=124"], "train.seq_len"),
    ],
)  # fmt: skip
def test_cli_bad_context_parallel_settings_exit_2_with_one_line(world, sets, key):
    args = ["--config", str(CONFIGS / "tiny.yaml"), "--world-size", str(world)]
    for s in sets:
        args += ["--set", s]
    assert_check_fails_with_one_line(args, key)


def test_cli_check_shows_the_zigzag_split():
    result = invoke_cli(
        "check", "--config", str(CONFIGS / "tiny.yaml"), "--set", "parallel.cp=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "world_size: 2  (tp 1 x cp 2 x dp 1 x pp 1" in result.stdout
    split = "64 tokens of every sequence each: chunks r and 3 - r of 4 chunks of 32"
    assert split in result.stdout


MASKED = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.vocab_size=64"]
MASKED += ["model.max_seq_len=16", "train.seq_len=16", "model.arch=llama", "model.n_kv_head=2"]


def _masked_batch():
    import torch

    gen = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 64, (2, 16), generator=gen)
    targets = torch.randint(0, 64, (2, 16), generator=gen)
    targets[:, :4] = -100  # all of cp rank 0's first chunk: the ranks count unequal tokens
    targets[0, 9] = -100
    return inputs, targets


def _masked_loss(rank, world):
    from megatronish.config import derive, load_config
    from megatronish.context import shard_sequence
    from megatronish.data_parallel.outside import reduce_gradients
    from megatronish.distributed.layout import ParallelState
    from megatronish.model import GPT
    from megatronish.objectives.registry import sequence_losses
    from megatronish.training.loss import mean_loss

    if world == 1:
        ps = ParallelState.single()
    else:
        ps = ParallelState.from_world(1, 1, 1, cp=world)
    cfg = load_config(None, MASKED + [f"parallel.cp={world}"])
    model = GPT(cfg, derive(cfg, world), ps)
    inputs, targets = (shard_sequence(x, world, ps.cp_rank) for x in _masked_batch())
    loss = sequence_losses(model, inputs, targets).total
    loss.backward()
    params = [p for p in model.parameters()]
    reduce_gradients(params, ps)
    return mean_loss(loss, ps), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_loss_and_gradients_are_the_mean_over_every_counted_token_whatever_cp_and_masking():
    import torch

    want_loss, want_grads = _masked_loss(0, 1)
    for loss, grads in run_on_ranks(_masked_loss, 2, timeout=60):
        assert abs(loss - want_loss) <= FP32_FEW_OPS_REL * want_loss
        for name, grad in want_grads.items():
            torch.testing.assert_close(
                grads[name], grad, rtol=FP32_REORDER, atol=FP32_GRAD_ABS, msg=name
            )
