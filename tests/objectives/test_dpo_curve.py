"""DPO against the formula: from the same tiny Llama (checkpoint.init_from_hf) and the same
pairs, our DPO run follows the curve of the DPO loss computed on transformers' log-probabilities
(each conversation run on its own, no packing, no document masks) and trained by
torch.optim.AdamW on the same pairs per step (tests/hf/curve.py's optimizer and schedule), its
reference log-probabilities those of the initial weights. At tp 1 in this process, within
PARITY_REL (tests/tolerances.py); the other layouts, in one 4-rank run, equal the tp 1 run
within LAYOUT_CURVE_REL: tp 2 x dp 2 with sequence parallelism and ZeRO-3 for the whole curve
(and so the reference within PARITY_REL), pp 2 x dp 2 and cp 2 x dp 2 for its first steps. The
validation metrics (every validation pair against its reference log-probabilities) after the
first steps and at the end are the formula's on transformers' log-probabilities, and the other
layouts' equal the tp 1 run's."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatronish.data.pairs import PairLoader, split_pairs
from megatronish.data.sources import open_prepared
from megatronish.distributed.layout import ParallelState
from megatronish.optim.optimizer import lr_at
from megatronish.training.preference import step_metrics
from tests.conftest import invoke_cli
from tests.hf.curve import (
    CURVE_STEPS,
    LLAMA_SHAPE,
    decays,
    reference_optimizers,
    run_settings,
)
from tests.parity import SP, assert_close, make_config, make_trainer, train_counted
from tests.ranks import run_on_ranks
from tests.tolerances import (
    DPO_LAYOUT_REWARD_ABS,
    DPO_REWARD_ABS,
    FP32_FEW_OPS_REL,
    LAYOUT_CURVE_REL,
    PARITY_REL,
)

transformers = pytest.importorskip("transformers")

SEQ_LEN = 64
PAIRS = 16
SHORT_STEPS = 4  # the pp and cp runs: the first steps of the curve
BETA = 0.1
DPO = [
    "train.objective=dpo",
    f"train.dpo.beta={BETA}",
    f"train.eval_every={CURVE_STEPS}",  # a validation loader (the tests call validation())
    f"train.seq_len={SEQ_LEN}",
    f"model.max_seq_len={SEQ_LEN}",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
]


def write_pairs(path: Path) -> Path:
    """PAIRS sums with a right and a wrong answer, as preference JSON Lines."""
    rng = np.random.default_rng(3)
    lines = []
    for a, b, off in rng.integers(1, 10, size=(PAIRS, 3)):
        lines.append(f'{{"prompt": "{a}+{b}", "chosen": "{a + b}", "rejected": "{a + b + off}"}}')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo-pairs")
    out = root / "pairs"
    source = write_pairs(root / "pairs.jsonl")
    args = ["--input", str(source), "--output", str(out), "--val-fraction", "0.25"]
    result = invoke_cli("prepare", "--preference", *args)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def hf_dir(pairs, tmp_path_factory) -> Path:
    """A tiny random Llama (fp32) on the byte vocabulary, positions for SEQ_LEN."""
    shape = dict(LLAMA_SHAPE, max_position_embeddings=SEQ_LEN)
    config = transformers.LlamaConfig(vocab_size=257, attn_implementation="eager", **shape)
    path = tmp_path_factory.mktemp("dpo-curve") / "llama"
    with torch.random.fork_rng():
        torch.manual_seed(11)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def conversation_logps(model: nn.Module, dataset: Path, pair_ids) -> torch.Tensor:
    """[n, 2]: the sums of transformers' log-probabilities of each pair's chosen and rejected
    response tokens (the dataset's counted targets), each conversation a sequence of its own."""
    source = open_prepared(dataset)
    rows = []
    for pair in pair_ids:
        for doc in (2 * int(pair), 2 * int(pair) + 1):
            first, end = int(source.offsets[doc]), int(source.offsets[doc + 1])
            ids = torch.from_numpy(np.asarray(source.tokens[first:end], dtype=np.int64))
            counted = torch.from_numpy(np.asarray(source.loss_mask[first + 1 : end]) == 1)
            logits = model(ids[None, :-1]).logits[0].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
            rows.append((logp * counted).sum())
    return torch.stack(rows).reshape(-1, 2)


def reference_validation(model: nn.Module, dataset: Path, reference: torch.Tensor) -> dict:
    """trl's sigmoid loss and rewards of the validation pairs under `model` (transformers)."""
    pairs = split_pairs(open_prepared(dataset), "val")
    model.eval()
    with torch.no_grad():
        rewards = BETA * (conversation_logps(model, dataset, pairs) - reference[pairs])
    model.train()
    margins = rewards[:, 0] - rewards[:, 1]
    return {
        "val_loss": -F.logsigmoid(margins).mean().item(),
        "val_rewards/chosen": rewards[:, 0].mean().item(),
        "val_rewards/rejected": rewards[:, 1].mean().item(),
        "val_rewards/margins": margins.mean().item(),
        "val_rewards/accuracies": (margins > 0).float().mean().item(),
    }


def reference_dpo_curve(
    model: nn.Module, decay: dict, cfg, dataset: Path
) -> tuple[list[float], dict]:
    """(the losses of training `model` (transformers) with torch AdamW on the DPO loss of the
    pairs our loader gives each step (its order at dp 1), as trl's sigmoid loss computes it,
    {step: reference_validation} after SHORT_STEPS and the last step)."""
    train = cfg.train
    named = dict(model.named_parameters())
    optimizers = reference_optimizers(named, decay, cfg)
    loader = PairLoader(
        dataset, "train", train.seq_len, train.global_batch_size, 1, 0, 1, train.seed
    )
    model.eval()
    with torch.no_grad():
        reference = conversation_logps(model, dataset, range(PAIRS))
    model.train()
    losses, validated = [], {}
    for step in range(1, train.steps + 1):
        loader.next_step_batch()
        ids = torch.from_numpy(loader.last_pairs)
        ratios = conversation_logps(model, dataset, ids) - reference[ids]
        loss = -F.logsigmoid(BETA * (ratios[:, 0] - ratios[:, 1])).mean()
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            optimizer.step()
        losses.append(loss.item())
        if step in (SHORT_STEPS, train.steps):
            validated[step] = reference_validation(model, dataset, reference)
    return losses, validated


@pytest.fixture(scope="module")
def curves(hf_dir, pairs, tmp_path_factory) -> dict:
    """Our tp 1 curve (with the metrics of its last step and the validation after SHORT_STEPS
    and CURVE_STEPS) and the transformers reference's."""
    settings = run_settings(hf_dir) + DPO
    cfg = make_config(1, 1, 1, settings, pairs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = make_trainer(cfg, 1, pairs, ParallelState.single())
        losses, norms, _ = train_counted(trainer, SHORT_STEPS)
        validated = {SHORT_STEPS: trainer.validation()}
        more_losses, more_norms, _ = train_counted(trainer, CURVE_STEPS)
        losses, norms = losses + more_losses, norms + more_norms
        validated[CURVE_STEPS] = trainer.validation()
        metrics = step_metrics(trainer.objective, trainer.ps)
        decay = decays(trainer, hf_dir, tmp_path_factory.mktemp("dpo-decay") / "flags")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
        reference, reference_validated = reference_dpo_curve(theirs, decay, cfg, pairs)
    finally:
        torch.set_num_threads(threads)
    return dict(
        losses=losses,
        norms=norms,
        reference=reference,
        settings=settings,
        metrics=metrics,
        validated=validated,
        reference_validated=reference_validated,
    )


@pytest.fixture(scope="module")
def layouts(curves, pairs) -> list[dict]:
    """Each rank's curves of the other layouts, in one 4-rank run."""
    settings = curves["settings"]
    runs = {  # name: ((tp, dp, pp, cp), settings, the steps of the 20-step schedule to run)
        "tp2-dp2": ((2, 2, 1, 1), settings + [*SP, "optim.zero=3"], CURVE_STEPS),
        "pp2-dp2": ((1, 2, 2, 1), settings, SHORT_STEPS),
        "cp2-dp2": ((1, 2, 1, 2), settings, SHORT_STEPS),
    }
    return run_on_ranks(train_layouts, 4, runs, pairs, timeout=400)


def train_layouts(rank: int, world: int, runs: dict, dataset: Path) -> dict[str, tuple]:
    """(the losses, the validation metrics at the end) of each run {name: ((tp, dp, pp, cp),
    settings, steps)} on these ranks."""
    curves = {}
    for name, ((tp, dp, pp, cp), settings, steps) in runs.items():
        cfg = make_config(tp, dp, pp, settings, dataset, cp=cp)
        trainer = make_trainer(cfg, world, dataset)
        losses, _, _ = train_counted(trainer, steps)
        curves[name] = (losses, trainer.validation())
    return curves


def test_the_dpo_curve_at_tp1_is_the_dpo_loss_of_transformers_log_probs_under_adamw(curves):
    reference, ours = curves["reference"], curves["losses"]
    assert ours[0] == pytest.approx(math.log(2), rel=FP32_FEW_OPS_REL)  # policy == reference
    assert reference[-1] < reference[0] - 0.05  # the pairs are learned
    assert_close(ours, reference, rel=PARITY_REL, steps=CURVE_STEPS)


def test_the_last_step_logs_the_rewards_their_margin_and_accuracy(curves):
    metrics = curves["metrics"]
    chosen, rejected = metrics["rewards/chosen"], metrics["rewards/rejected"]
    assert metrics["rewards/margins"] == pytest.approx(chosen - rejected, rel=FP32_FEW_OPS_REL)
    assert metrics["rewards/margins"] > 0 and 0 < metrics["rewards/accuracies"] <= 1


def assert_validation_equal(ours: dict, theirs: dict, rel: float, reward_abs: float) -> None:
    """The val_loss within rel, the rewards and their margin within reward_abs (the bound
    tests/tolerances.py derives from rel); the accuracy a share (a margin within the bound of
    zero may flip it)."""
    assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=rel)
    for name in ("val_rewards/chosen", "val_rewards/rejected", "val_rewards/margins"):
        assert ours[name] == pytest.approx(theirs[name], abs=reward_abs), name
    assert 0 <= ours["val_rewards/accuracies"] <= 1


def test_the_validation_at_tp1_is_the_dpo_loss_and_rewards_of_transformers_log_probs(curves):
    for step, theirs in curves["reference_validated"].items():
        ours = curves["validated"][step]
        assert_validation_equal(ours, theirs, PARITY_REL, DPO_REWARD_ABS)
    last = curves["validated"][CURVE_STEPS]
    assert last["val_loss"] != pytest.approx(math.log(2), rel=PARITY_REL)  # it moved
    want = curves["reference_validated"][CURVE_STEPS]["val_rewards/accuracies"]
    assert last["val_rewards/accuracies"] == want


@pytest.mark.slow  # a 4-rank run
@pytest.mark.parametrize("layout", ["tp2-dp2", "pp2-dp2", "cp2-dp2"])
def test_a_dpo_run_at_tp_sp_zero_pp_or_cp_with_dp2_equals_the_run_at_tp1(curves, layouts, layout):
    for ranks in layouts:
        ours, validated = ranks[layout]
        assert_close(ours, curves["losses"][: len(ours)], rel=LAYOUT_CURVE_REL, steps=len(ours))
        want = curves["validated"][len(ours)]  # the tp 1 run's validation at the same step
        assert_validation_equal(validated, want, LAYOUT_CURVE_REL, DPO_LAYOUT_REWARD_ABS)
        if layout == "tp2-dp2":
            assert_close(ours, curves["reference"], rel=PARITY_REL, steps=CURVE_STEPS)
