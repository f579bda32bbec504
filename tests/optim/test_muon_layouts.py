"""Muon at every layout: a matrix split over tp is orthogonalized whole (its ranks' blocks
gathered in bf16), so where the gradients are bitwise those of one process, so are the updates,
and the gathers are counted as what they send; and training runs at tp 2 with sequence
parallelism x dp 2, tp 2 x pp 2 interleaved, tp 2 x ep 2 with experts, and cp 2 x dp 2 give
one process's losses, gradient norms and QK-clip's max_attn_logit (tau set: it clips heads
every step) within the reference's noise floor x 10 (MUON_CURVE_REL, MUON_NORM_REL,
MUON_LOGIT_REL: Newton-Schulz in bf16 passes fp32 reorderings on amplified), their all-gathers'
bytes (cp's QK-clip key gathers too) those accounting.collectives counts."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatronish.accounting.collectives import formula_payload_by_kind
from megatronish.config import load_config
from megatronish.distributed import comm
from megatronish.fp8.parts import Parts
from megatronish.layers.linear import mark_parallel
from megatronish.optim.muon import MuonOptimizer
from megatronish.optim.muon_matrices import Matrix
from tests.parity import (
    LLAMA,
    MTP,
    SP,
    assert_close,
    make_config,
    make_trainer,
    run_reference,
    train_counted,
)
from tests.ranks import run_on_ranks
from tests.tolerances import FP32_REORDER, MUON_CURVE_REL, MUON_LOGIT_REL, MUON_NORM_REL

# QK-clip on: at tau 0.045 (the tiny model's largest logits start near 0.05) it clips heads
# every step, so the curves and each step's max_attn_logit hold its reduction and scaling too
MUON = ["optim.name=muon", "train.weight_decay=0.1", "optim.muon.qk_clip_tau=0.045"]
LAYOUT_STEPS = 5  # the layouts' runs and their references: half the parity harness's
SHORT = [f"train.steps={LAYOUT_STEPS}"]
# A fused layer's repeating unit of rows (4 query rows, a key's 2 and a value's 2) and a
# row-parallel matrix [6, 10]: full shapes, split over tp 2 on dims 0 and 1.
PARTS = Parts((4, 2, 2))
FUSED, ROW = (16, 6), (6, 10)


def _muon_update(fused: nn.Parameter, row: nn.Parameter, group):
    matrices = [Matrix(fused, None, k, PARTS, 0) for k in range(3)]
    matrices.append(Matrix(row, None, None, None, 1))
    cfg = load_config(None, [*MUON, "train.lr=0.02"])
    groups = [
        {
            "params": [fused, row],
            "weight_decay": 0.1,
            "muon": True,
            "matrices": matrices,
            "tp_group": group,
        }
    ]
    return MuonOptimizer().build(groups, cfg)


def _steps(fused: nn.Parameter, row: nn.Parameter, grads: list, group, blocks) -> dict:
    """Three Muon steps of the two parameters (each rank's blocks of the full gradients),
    the weights after them and the collectives of the steps."""
    update = _muon_update(fused, row, group)
    with comm.CommCounter() as counter:
        for fused_grad, row_grad in grads:
            fused.grad, row.grad = blocks(fused_grad, 0), blocks(row_grad, 1)
            update.step()
    return {"fused": fused.detach().clone(), "row": row.detach().clone(), "counter": counter}


def _full_weights_and_grads():
    torch.manual_seed(0)
    weights = torch.randn(FUSED), torch.randn(ROW)
    grads = [(torch.randn(FUSED), torch.randn(ROW)) for _ in range(3)]
    return weights, grads


def _split_muon_rank(rank: int, world: int) -> dict:
    (fused, row), grads = _full_weights_and_grads()
    fused, row = nn.Parameter(fused.chunk(world, 0)[rank]), nn.Parameter(row.chunk(world, 1)[rank])
    mark_parallel(fused, 0, FUSED)
    mark_parallel(row, 1, ROW)
    result = _steps(fused, row, grads, dist.group.WORLD, lambda t, dim: t.chunk(world, dim)[rank])
    counter = result.pop("counter")
    result["gathered"] = (counter.calls["all_gather"], counter.payload_bytes["all_gather"])
    result["sent"] = counter.sent_bytes["all_gather"]
    return result


def test_a_matrix_split_over_tp_gets_one_processs_update_bit_for_bit_and_its_gathers_counted():
    (fused, row), grads = _full_weights_and_grads()
    fused, row = nn.Parameter(fused), nn.Parameter(row)
    whole = _steps(fused, row, grads, None, lambda t, dim: t.clone())
    assert whole["counter"].calls == {}  # one rank: nothing gathered
    ranks = run_on_ranks(_split_muon_rank, 2, timeout=60)
    for rank, got in enumerate(ranks):
        assert torch.equal(got["fused"], whole["fused"].chunk(2, 0)[rank])
        assert torch.equal(got["row"], whole["row"].chunk(2, 1)[rank])
        # per step one bf16 gather of each whole matrix: q [8, 6], k and v [4, 6], the row's
        payload = 3 * (8 * 6 + 4 * 6 + 4 * 6 + 6 * 10) * 2
        assert got["gathered"] == (3 * 4, payload)
        assert got["sent"] == payload / 2  # (n - 1) / n of each gathered matrix


EXPERTS = [
    *LLAMA,
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=24",
    "model.moe.aux_loss_coef=0",
]
# name -> (tp, dp, pp, overrides, cp): each against its one-process run of the same settings
VARIANTS = {
    "llama mtp tp2 sp dp2": (2, 2, 1, LLAMA + MTP + SP, None),
    "llama tp2 pp2 interleaved": (
        2, 1, 2, LLAMA + ["parallel.pp_virtual=2", "train.micro_batch_size=2"], None,
    ),
    "experts tp2 dp2 ep2 sp": (2, 2, 1, EXPERTS + SP + ["parallel.ep=2"], None),
    "llama cp2 dp2": (1, 2, 1, LLAMA, 2),
}  # fmt: skip
# ZeRO level -> tp 2 + SP x dp 2 at it, each against one process of LLAMA (one reference)
ZERO_VARIANTS = {
    f"llama tp2 sp dp2 zero{z}": (2, 2, 1, LLAMA + SP + [f"optim.zero={z}"], None)
    for z in (1, 2, 3)
}
# the same layout at ZeRO-0 (Muon's gradients all-reduced), which ZeRO-1 equals bit for bit
ZERO0 = {"llama tp2 sp dp2 zero0": (2, 2, 1, LLAMA + SP + ["optim.zero=0"], None)}


SAVED = "llama tp2 sp dp2 zero2"  # saves at SAVED_AT, resumed at two layouts
SAVED_AT = 3
RESUMED = {"tp2 sp dp2 zero2": (2, 2, LLAMA + SP, 2), "tp1 dp4 zero1": (1, 4, LLAMA, 1)}


def _train_on_ranks(rank: int, world: int, dataset, ckpt_dir) -> dict:
    results = {}
    for name, (tp, dp, pp, overrides, cp) in {**VARIANTS, **ZERO_VARIANTS, **ZERO0}.items():
        save = [f"checkpoint.dir={ckpt_dir}", "checkpoint.save=true"] if name == SAVED else []
        cfg = make_config(tp, dp, pp, overrides + MUON + SHORT, dataset, save, cp=cp)
        trainer = make_trainer(cfg, world, dataset)
        holding = _watch_muon_grads(trainer) if name in ZERO_VARIANTS else None
        every = SAVED_AT if name == SAVED else 0
        logits: list = []
        losses, norms, counter = train_counted(trainer, LAYOUT_STEPS, every, logits=logits)
        trainer.saver.finish()
        setup = trainer.setup
        formula = formula_payload_by_kind(cfg, setup.derived, setup.ps.pp_rank)
        gathered = (counter.payload_bytes.get("all_gather", 0), formula.get("all_gather", 0))
        results[name] = {"losses": losses, "norms": norms, "gathered": gathered, "logits": logits}
        if name in ZERO_VARIANTS:
            results[name].update(_zero_facts(trainer, counter, formula), holding=holding)
    resume = f"checkpoint.resume={ckpt_dir / f'step_{SAVED_AT:06d}'}"
    for name, (tp, dp, overrides, zero) in RESUMED.items():
        sets = overrides + MUON + SHORT + [f"optim.zero={zero}", resume]
        trainer = make_trainer(make_config(tp, dp, 1, sets, dataset), world, dataset)
        steps = [trainer.train_step() for _ in range(LAYOUT_STEPS - SAVED_AT)]
        results[f"resumed at {name}"] = [s.loss for s in steps]
    return results


def _watch_muon_grads(trainer) -> list[bool]:
    """Records, at each step's gradient clipping (after the reductions), whether the Muon
    parameters holding a gradient on this rank are exactly those it owns."""
    data_parallel, holding = trainer.data_parallel, []
    clip = data_parallel.clip_grads
    every = MuonOptimizer().needs_whole(trainer.model)
    update = data_parallel.update
    owned = {id(p) for g in update.param_groups if g.get("muon") for p in g["params"]}

    def clip_grads(max_norm: float) -> float:
        holding.append({id(p) for p in every if p.grad is not None} == owned)
        return clip(max_norm)

    data_parallel.clip_grads = clip_grads
    return holding


def _zero_facts(trainer, counter, formula: dict) -> dict:
    """What a ZeRO run shows of Muon's layer-wise ownership: the elements of the momentum this
    rank keeps and of every Muon matrix it holds a block of, the broadcasts' and the reduces'
    (of Muon's gradients to their owners) bytes: counted, the accounting's and sent."""
    update = trainer.data_parallel.update
    muon = [p for g in update.param_groups if g.get("muon") for p in g["params"]]
    every = {
        id(m.param): m.param for m in MuonOptimizer().param_groups(trainer.model, 0)[0]["matrices"]
    }
    kept = sum(
        s["momentum_buffer"].numel() for s in update.state.values() if "momentum_buffer" in s
    )
    return {
        "momentum": (kept, sum(p.numel() for p in muon), sum(p.numel() for p in every.values())),
        **{
            kind: (
                counter.payload_bytes.get(kind, 0),
                formula.get(kind, 0),
                counter.sent_bytes.get(kind, 0),
            )
            for kind in ("broadcast", "reduce")
        },
    }


def assert_logits_close(got: list[float], want: list[float]) -> None:
    """QK-clip's max_attn_logit of each step: the first (the same weights, maxima reduced over
    other ranks) to fp32 reordering, every step to the reference's noise floor x 10."""
    assert abs(got[0] - want[0]) <= FP32_REORDER * want[0]
    assert_close(got, want, rel=MUON_LOGIT_REL, steps=LAYOUT_STEPS)


@pytest.fixture(scope="module")
def four_ranks(dataset, tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("muon-zero")
    return run_on_ranks(_train_on_ranks, 4, dataset, ckpt_dir, timeout=400)


@functools.cache
def muon_reference(settings: tuple[str, ...], dataset: Path) -> tuple[list[float], ...]:
    """The one-process run's LAYOUT_STEPS losses, gradient norms and max_attn_logits, once per
    settings (LLAMA's serves the pp 2, cp 2 and ZeRO layouts)."""
    ref = run_reference([*settings, *MUON, *SHORT], dataset, steps=LAYOUT_STEPS)
    return tuple(ref[key] for key in ("losses", "norms", "max_attn_logits"))


@pytest.mark.slow  # a 4-rank training run
@pytest.mark.parametrize("name", list(VARIANTS))
def test_muon_at_every_layout_gives_the_losses_and_grad_norms_of_one_process(
    name, four_ranks, dataset
):
    settings = [o for o in VARIANTS[name][3] if not o.startswith(("parallel.", "train.micro"))]
    losses, norms, logits = muon_reference(tuple(settings), dataset)
    assert losses[-1] < losses[0] - 0.2  # the runs really learn
    assert logits[0] > 0.045  # QK-clip clips
    for rank_results in four_ranks:
        got = rank_results[name]
        assert_close(got["losses"], losses, rel=MUON_CURVE_REL, steps=LAYOUT_STEPS)
        assert_close(got["norms"], norms, rel=MUON_NORM_REL, steps=LAYOUT_STEPS)
        assert_logits_close(got["logits"], logits)
        counted, formula = rank_results[name]["gathered"]
        assert counted == formula  # Muon's tp gathers (and SP's) as accounting counts them


@pytest.mark.slow  # the 4-rank training run
@pytest.mark.parametrize("name", list(ZERO_VARIANTS))
def test_muon_under_zero_owns_matrices_whole_reduces_their_gradients_to_the_owner_alone(
    name, four_ranks, dataset
):
    losses, norms, logits = muon_reference(tuple(LLAMA), dataset)
    momenta = []
    for rank_results in four_ranks:
        got = rank_results[name]
        assert_close(got["losses"], losses, rel=MUON_CURVE_REL, steps=LAYOUT_STEPS)
        assert_close(got["norms"], norms, rel=MUON_NORM_REL, steps=LAYOUT_STEPS)
        assert_logits_close(got["logits"], logits)
        # the owners' updated matrices (and SP's norms) broadcast as accounting counts them,
        # of which (n - 1) / n is sent
        counted, formula, sent = got["broadcast"]
        assert counted == formula > 0
        assert sent == counted / 2
        # Muon's gradients reduced to their owners (half an all-reduce's bytes sent), which
        # alone hold them after the reduction
        counted, formula, sent = got["reduce"]
        assert counted == formula > 0
        assert sent == counted / 2
        assert got["holding"] == [True] * LAYOUT_STEPS
        if name.endswith("zero1"):  # the same sums as ZeRO-0's all-reduce: the same bits
            assert got["losses"] == rank_results[next(iter(ZERO0))]["losses"]
        kept, owned, every = got["momentum"]
        assert kept == owned < every  # momentum for the matrices this rank owns only
        momenta.append((kept, every, got["gathered"]))
    # ranks 0, 2 are the dp ranks of tp rank 0 (1, 3 of tp rank 1): together they own each
    # matrix once
    for tp_rank in (0, 1):
        pair = [momenta[r] for r in range(4) if r % 2 == tp_rank]
        assert pair[0][0] + pair[1][0] == pair[0][1]
        # a rank gathers over tp only the matrices it owns: accounting counts the dp
        # group's average, so the pair's gathers are twice its count
        assert pair[0][2][0] + pair[1][2][0] == 2 * pair[0][2][1]


@pytest.mark.slow  # the 4-rank training run
def test_a_muon_zero2_checkpoint_resumes_bit_for_bit_and_reshards_to_tp1_dp4_zero1(four_ranks):
    for rank_results in four_ranks:
        after = rank_results[SAVED]["losses"][SAVED_AT:]
        assert rank_results["resumed at tp2 sp dp2 zero2"] == after
        resharded = rank_results["resumed at tp1 dp4 zero1"]
        assert_close(resharded, after, rel=MUON_CURVE_REL, steps=LAYOUT_STEPS - SAVED_AT)
