"""ZeRO-2 (gradients sharded too) and ZeRO-3 (parameters too) against ZeRO-0 at the same layout: at
dp 4, dp 2 x tp 2 with sequence parallelism, dp 2 x pp 2 (1F1B, GPipe, and interleaved with tied
embeddings), dp 2 x cp 2 with selective recompute, a MoE at dp 4 x ep 2 (expert buckets over the
expert-data-parallel group; DeepSeek-V3's MoE at tp 2 with sequence parallelism x dp 2 x ep 2) and
dp 4 with full recompute in bf16 (these two and dp 2 x pp 2 with multi-token prediction), and at
dp 2 with gradient
accumulation, the losses and gradient norms hold 1e-6 of ZeRO-0 (in bf16 the steps after the
first hold bf16's rounding, BF16_REL; ZeRO-2 is bitwise ZeRO-1 where a step has one
micro-batch), every rank sends the payload the analytic count gives (ZeRO-3's gathers
included), the model state each rank holds between steps, counted from the tensors'
storages, is plan's estimate within 5% at every level (at ZeRO-3 16 P / dp), the overlap and the
prefetch change no bit, the validation loss is ZeRO-0's, and a ZeRO-2 or 3 checkpoint (ZeRO-3's
saved in the background) resumes at another dp and level on the curve. With the gradients
reduced in bf16 (optim.grad_reduce_dtype) at dp 2, each reduced gradient is the fp32 one to two
bf16 roundings, the grad norm and losses follow from that, ZeRO-0 to 3 give the same curve at
one micro-batch a step (to fp32 summation order), and half the gradient bytes are sent.
`check` and plan's estimate shard weights, gradients and AdamW state by level, and count
ZeRO-3's gathers; optim.zero outside 0..3 and optim.grad_reduce_dtype outside fp32 and bf16 are
one line each.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CONFIGS
from tests.moe.layouts import DEEPSEEK, MOE
from tests.parity import (
    GPT2,
    LLAMA,
    MTP,
    OVERLAP,
    OVERLAP_REL,
    SP,
    assert_check_fails_with_one_line,
    make_config,
    make_trainer,
)
from tests.ranks import run_on_ranks
from tests.tolerances import (
    BF16_REDUCE_REL,
    BF16_UPDATE_REL,
    EXACT,
    LAYOUT_CURVE_REL,
    MODEL_STATE_ESTIMATE_REL,
    PRINTED_HUNDREDTHS_ABS,
    PRINTED_QUARTER_PAIR_ABS,
    ZERO_BF16_CURVE_REL,
    ZERO_CURVE_REL,
)

pytestmark = pytest.mark.slow  # four-rank training at every ZeRO level

STEPS, SAVED_AT = 4, 2
LEVELS = (0, 2, 3)
SELECTIVE = GPT2 + ["train.activation_checkpointing=selective"]
FULL_BF16 = LLAMA + ["train.activation_checkpointing=full", "train.precision=bf16"]
# name -> (tp, cp, dp, pp, ep, overrides); all four ranks
FOUR = {
    "dp4": (1, 1, 4, 1, 1, GPT2),
    "dp2 tp2 sp": (2, 1, 2, 1, 1, GPT2 + SP),
    "dp2 pp2 mtp": (1, 1, 2, 2, 1, LLAMA + MTP),
    "dp2 pp2 gpipe": (1, 1, 2, 2, 1, GPT2 + ["parallel.pp_schedule=gpipe"]),
    "dp2 pp2 interleaved tied": (1, 1, 2, 2, 1, GPT2 + ["parallel.pp_virtual=2"]),
    "dp2 cp2 selective recompute": (1, 2, 2, 1, 1, SELECTIVE),
    "moe dp4 ep2": (1, 1, 4, 1, 2, MOE),
    "deepseek moe dp2 ep2 tp2 sp": (2, 1, 2, 1, 2, DEEPSEEK + SP),
    "dp4 full recompute bf16 mtp": (1, 1, 4, 1, 1, FULL_BF16 + MTP),
}
# parallel.tp_comm_overlap on these four ranks: name -> (tp, dp, zero, overrides); each against
# the same run without it (tp 2 x dp 2 under ZeRO-3 against FOUR's "dp2 tp2 sp" at ZeRO-3)
TP_OVERLAP = {
    "dp2 tp2 sp overlap": (2, 2, 3, GPT2 + SP + OVERLAP),
    "tp4 sp": (4, 1, 0, GPT2 + SP),
    "tp4 sp overlap": (4, 1, 0, GPT2 + SP + OVERLAP),
}
# dp 2, two micro-batches a step: reduce-scatters and gathers every micro-batch
TWO = {
    "zero0": ["optim.zero=0"],
    "zero2": ["optim.zero=2"],
    "zero3": ["optim.zero=3"],
    "zero2 overlap off": ["optim.zero=2", "optim.overlap_grad_reduce=false"],
    "zero3 overlap off": ["optim.zero=3", "optim.overlap_grad_reduce=false"],
    "zero3 prefetch off": ["optim.zero=3", "optim.zero3_prefetch=false"],
}

# dp 2 with the gradients reduced in bf16: one micro-batch a step (ZeRO-0, overlap off, has its
# first reduction captured; ZeRO-1 to 3 with the overlap), and ZeRO-3 with two (reduced each)
BF16 = ["optim.grad_reduce_dtype=bf16"]
ONE_MICRO_BATCH = ["train.micro_batch_size=4"]
BF16_TWO = {
    "zero0 bf16": ["optim.zero=0", "optim.overlap_grad_reduce=false", *BF16, *ONE_MICRO_BATCH],
    "zero1 bf16": ["optim.zero=1", *BF16, *ONE_MICRO_BATCH],
    "zero2 bf16": ["optim.zero=2", *BF16, *ONE_MICRO_BATCH],
    "zero3 bf16": ["optim.zero=3", *BF16, *ONE_MICRO_BATCH],
    "zero3 bf16 accumulated": ["optim.zero=3", *BF16],
}


def _capture_first_reduction(trainer) -> dict:
    """Wraps ZeRO-0's _finish_buckets (with the overlap off nothing is sent before it): the
    dict returned gets the first step's local gradients ("local") and reduced ones
    ("reduced")."""
    dp = trainer.data_parallel
    finish, seen = dp._finish_buckets, {}

    def wrapped():
        seen.setdefault("local", dp.grad_buffer.clone())
        finish()
        seen.setdefault("reduced", dp.grad_buffer.clone())

    dp._finish_buckets = wrapped
    return seen


def _held_bytes(trainer) -> int:
    """Bytes of the distinct storages of the parameters, gradients and optimizer state this
    rank holds."""
    dp = trainer.data_parallel
    tensors = [*trainer.model.parameters()]
    tensors += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    # the level's flat tensors: gradients (ZeRO-0 and 1 whole, 2 and 3 shards), parameters
    # (ZeRO-1 and 2 flat, 3 the shards and each bucket's gathered tensor)
    for name in ("grad_buffer", "grad_shards", "flat_params"):
        if hasattr(dp, name):
            tensors.append(getattr(dp, name))
    if hasattr(dp, "shards"):
        tensors += [dp.shards.owned] + [bucket.full for bucket in dp.buckets]
    tensors += [t for st in dp.update.state.values() for t in st.values()]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(storages.values())


def _train(cfg, world, dataset, save: bool = False, capture: bool = False) -> dict:
    """The run's curve, first-step payload and formula, held bytes and estimate; with capture
    (ZeRO-0, overlap off) its first reduction: "reduced", and of the same local gradients the
    fp32 average "fp32" and the mean of the ranks' magnitudes "magnitude"."""
    from megatronish.accounting.collectives import formula_payload_by_kind
    from megatronish.accounting.model_state import model_state_bytes
    from megatronish.distributed import comm

    trainer = make_trainer(cfg, world, dataset)
    seen = _capture_first_reduction(trainer) if capture else {}
    curve = []
    for _ in range(STEPS):
        with comm.CommCounter() as counter:
            result = trainer.train_step()
        curve.append((result.loss, result.grad_norm))
        if trainer.step == 1:
            payload = dict(counter.payload_bytes)
        if save and trainer.step == SAVED_AT:
            trainer.save_checkpoint()
    trainer.saver.finish()  # checkpoint.async: the save on disk
    trainer.saver.close()
    if seen:
        fp32, magnitude = seen["local"].clone(), seen["local"].abs()
        for tensor in (fp32, magnitude):
            comm.all_reduce(tensor, trainer.ps.dp_cp_group)
            tensor /= trainer.ps.dp_cp
        seen = {"reduced": seen["reduced"], "fp32": fp32, "magnitude": magnitude}
    estimate = model_state_bytes(cfg, trainer.setup.derived, trainer.ps.pp_rank)
    return {
        "curve": curve,
        "payload": {k: v for k, v in payload.items() if k != "all_to_all"},  # routing-dependent
        "formula": {
            k: v
            for k, v in formula_payload_by_kind(
                cfg, trainer.setup.derived, trainer.ps.pp_rank
            ).items()
            if k != "all_to_all"
        },
        "held": _held_bytes(trainer),
        "estimate": estimate["weights"] + estimate["grads"] + estimate["optimizer"],
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "trainer": trainer,
        "reduction": seen,
    }


def _four(rank, world, dataset, ckpt_dir):
    out = {}
    for name, (tp, cp, dp, pp, ep, overrides) in FOUR.items():
        for zero in (0, 1, 2, 3) if name == "dp4" else LEVELS:
            save = name == "dp4" and zero >= 2
            extra = [f"train.steps={STEPS}", f"optim.zero={zero}"]
            if save:  # ZeRO-3's in the background
                extra += [
                    "checkpoint.save=true",
                    f"checkpoint.dir={ckpt_dir / f'zero{zero}'}",
                    f"checkpoint.async={str(zero == 3).lower()}",
                ]
            cfg = make_config(tp, dp, pp, overrides, dataset, extra, cp=cp, ep=ep)
            run = _train(cfg, world, dataset, save)
            del run["trainer"]
            out[(name, zero)] = run
    for name, (tp, dp, zero, overrides) in TP_OVERLAP.items():
        cfg = make_config(
            tp, dp, 1, overrides, dataset, [f"train.steps={STEPS}", f"optim.zero={zero}"]
        )
        run = _train(cfg, world, dataset)
        del run["trainer"]
        out[(name, zero)] = run
    return out


def _two(rank, world, dataset, ckpt_dir):
    out = {}
    for name, sets in TWO.items():
        evaluated = ["train.eval_every=100", "train.eval_steps=1"]
        cfg = make_config(1, 2, 1, GPT2, dataset, [f"train.steps={STEPS}", *evaluated, *sets])
        run = _train(cfg, world, dataset)
        if name in ("zero0", "zero3"):
            run["val_loss"] = run["trainer"].evaluate()
        del run["trainer"]
        out[name] = run
    for name, sets in BF16_TWO.items():
        cfg = make_config(1, 2, 1, GPT2, dataset, [f"train.steps={STEPS}", *sets])
        run = _train(cfg, world, dataset, capture=name == "zero0 bf16")
        del run["trainer"]
        out[name] = run
    # dp 4 checkpoints resumed at dp 2, at the other level
    for saved, zero in ((2, 3), (3, 2)):
        resume = f"checkpoint.resume={ckpt_dir / f'zero{saved}' / f'step_{SAVED_AT:06d}'}"
        cfg = make_config(
            1, 2, 1, GPT2, dataset, [f"train.steps={STEPS}", f"optim.zero={zero}", resume]
        )
        trainer = make_trainer(cfg, world, dataset)
        steps = [trainer.train_step() for _ in range(STEPS - SAVED_AT)]
        out[f"zero{saved} resumed at zero{zero}"] = [(s.loss, s.grad_norm) for s in steps]
    return out


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("zero-levels")
    four = run_on_ranks(_four, 4, dataset, ckpt_dir, timeout=240)
    two = run_on_ranks(_two, 2, dataset, ckpt_dir, timeout=240)
    return four, two


def _flat(curve) -> list[float]:
    return [x for pair in curve for x in pair]


@pytest.mark.parametrize("name", list(FOUR))
def test_zero2_and_zero3_losses_and_grad_norms_hold_zero0s_to_fp32_or_bf16_rounding(name, runs):
    four, _ = runs
    want = four[0][(name, 0)]["curve"]
    assert want[-1][0] < want[0][0]  # it learns
    later = ZERO_BF16_CURVE_REL if "bf16" in name else ZERO_CURVE_REL
    for rank in four:
        for zero in (2, 3):
            got = rank[(name, zero)]["curve"]
            assert got[0] == pytest.approx(want[0], rel=ZERO_CURVE_REL, abs=EXACT), (
                zero
            )  # same weights
            assert _flat(got[1:]) == pytest.approx(_flat(want[1:]), rel=later, abs=EXACT), zero
    for rank in four:  # one micro-batch a step: ZeRO-2 reduces as ZeRO-1 does, bit for bit
        assert rank[("dp4", 2)]["curve"] == rank[("dp4", 1)]["curve"]


def test_tp_comm_overlap_at_tp2_dp2_zero3_and_tp4_equals_it_off_to_1e6(runs):
    four, _ = runs
    pairs = [(("dp2 tp2 sp overlap", 3), ("dp2 tp2 sp", 3)), (("tp4 sp overlap", 0), ("tp4 sp", 0))]
    for rank in four:
        for on, off in pairs:
            want = _flat(rank[off]["curve"])
            assert _flat(rank[on]["curve"]) == pytest.approx(want, rel=OVERLAP_REL, abs=EXACT), on


def test_zero_levels_at_dp2_with_accumulation_hold_1e6_and_overlap_and_prefetch_change_no_bit(
    runs,
):
    _, two = runs
    want = _flat(two[0]["zero0"]["curve"])
    for rank in two:
        for name in TWO:
            assert _flat(rank[name]["curve"]) == pytest.approx(
                want, rel=ZERO_CURVE_REL, abs=EXACT
            ), name
        assert rank["zero2 overlap off"]["curve"] == rank["zero2"]["curve"]
        assert rank["zero3 overlap off"]["curve"] == rank["zero3"]["curve"]
        assert rank["zero3 prefetch off"]["curve"] == rank["zero3"]["curve"]
        assert rank["zero3"]["val_loss"] == pytest.approx(
            rank["zero0"]["val_loss"], rel=ZERO_CURVE_REL
        )


def test_bf16_gradient_reduction_is_the_fp32_one_to_two_bf16_roundings_at_dp2(runs):
    """Each reduced gradient is a bf16 value within BF16_REDUCE_REL of the ranks' mean
    magnitude of the fp32 average (most differ from it: the reduction did round); the first
    grad norm, that of the reduced gradients, is the fp32 run's within the norm of that bound;
    the losses after it move from the fp32 run's by at most 2^-7 of how far the loss has moved
    (AdamW's update is a ratio of moments of a gradient rounded to 2^-7)."""
    _, two = runs
    fp32 = two[0]["zero0"]["curve"]
    for rank in two:
        seen = rank["zero0 bf16"]["reduction"]
        reduced, want, magnitude = seen["reduced"], seen["fp32"], seen["magnitude"]
        assert torch.equal(reduced.bfloat16().float(), reduced)  # bf16 values
        assert ((reduced - want).abs() <= BF16_REDUCE_REL * magnitude).all()
        assert (reduced != want).float().mean() > 0.5
        got = rank["zero0 bf16"]["curve"]
        norm_bound = BF16_REDUCE_REL * magnitude.norm().item()
        assert abs(got[0][1] - fp32[0][1]) <= norm_bound
        assert got[0][0] == fp32[0][0]  # the same weights
        for step in range(1, STEPS):
            moved = abs(fp32[step][0] - fp32[0][0])
            assert abs(got[step][0] - fp32[step][0]) <= BF16_UPDATE_REL * moved, step
        # two micro-batches, each reduce-scattered in bf16: the same bounds
        accumulated = rank["zero3 bf16 accumulated"]["curve"]
        for step in range(1, STEPS):
            moved = abs(fp32[step][0] - fp32[0][0])
            assert abs(accumulated[step][0] - fp32[step][0]) <= BF16_UPDATE_REL * moved, step


def test_bf16_reduction_gives_the_same_curve_at_zero0_to_3_and_halves_gradient_bytes(runs):
    """One micro-batch a step: ZeRO-0's all-reduce and ZeRO-1 to 3's reduce-scatters round the
    same sums (shared memory adds in rank order), so only the norm's fp32 summation order
    differs; the reduce-scatters send half the fp32 run's bytes (every payload is the analytic
    count's: test_every_rank_sends_the_payload_the_analytic_count_gives...)."""
    _, two = runs
    for rank in two:
        want = _flat(rank["zero0 bf16"]["curve"])
        for zero in (1, 2, 3):
            got = _flat(rank[f"zero{zero} bf16"]["curve"])
            assert got == pytest.approx(want, rel=ZERO_CURVE_REL, abs=EXACT), zero
        assert rank["zero1 bf16"]["curve"] == rank["zero2 bf16"]["curve"]
        scatter = rank["zero3"]["payload"]["reduce_scatter"]
        assert rank["zero3 bf16 accumulated"]["payload"]["reduce_scatter"] * 2 == scatter


def test_every_rank_sends_the_payload_the_analytic_count_gives_zero3_gathers_included(runs):
    four, two = runs
    for rank in four:
        for key, run in rank.items():
            assert run["payload"] == run["formula"], key
            if key[1] == 3:
                assert run["payload"]["all_gather"] > 0
    for rank in two:
        for name in [*TWO, *BF16_TWO]:
            assert rank[name]["payload"] == rank[name]["formula"], name


def test_model_state_held_between_steps_is_plans_estimate_at_every_zero_level(runs):
    four, _ = runs
    for rank in four:
        held = {zero: rank[("dp4", zero)]["held"] for zero in (0, 1, 2, 3)}
        for zero, count in held.items():
            assert count == pytest.approx(
                rank[("dp4", zero)]["estimate"], rel=MODEL_STATE_ESTIMATE_REL
            ), zero
        assert held[0] > held[1] > held[2] > held[3]
        assert (
            held[3] <= (1 + MODEL_STATE_ESTIMATE_REL) * 16 * rank[("dp4", 3)]["params"] / 4
        )  # 16 P / dp


def test_zero2_and_zero3_checkpoints_resume_at_another_dp_and_level_on_the_curve(runs):
    four, two = runs
    after = _flat(four[0][("dp4", 0)]["curve"][SAVED_AT:])
    for rank in two:
        for saved, zero in ((2, 3), (3, 2)):
            got = _flat(rank[f"zero{saved} resumed at zero{zero}"])
            assert got == pytest.approx(after, rel=LAYOUT_CURVE_REL)


def test_check_and_plan_shard_weights_gradients_and_state_by_level_with_zero3_gathers():
    import re

    from megatronish.accounting.memory import estimate
    from megatronish.config import load_config
    from megatronish.data import ByteTokenizer
    from tests.conftest import invoke_cli

    mib = r"([0-9.]+) MiB"
    report, payload = {}, {}
    for zero in (0, 1, 2, 3):
        sets = [
            "parallel.dp=4",
            "train.global_batch_size=64",
            f"optim.zero={zero}",
            f"model.vocab_size={ByteTokenizer().vocab_size}",
        ]
        args = [x for item in sets for x in ("--set", item)]
        out = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), *args)
        assert out.returncode == 0, out.stderr
        state = re.search(f"weights {mib}, gradients {mib}, AdamW {mib}", out.stdout)
        report[zero] = [float(x) for x in state.groups()]
        gathers = re.search(f"all_gather {mib}", out.stdout)
        payload[zero] = float(gathers.group(1)) if gathers else 0.0
        cfg = load_config(CONFIGS / "tiny.yaml", sets)
        plan = estimate(cfg, 4, 1)
        assert [plan.weights_gb, plan.grads_gb, plan.optimizer_gb] == pytest.approx(
            [x / 1024 for x in report[zero]], abs=PRINTED_HUNDREDTHS_ABS / 1024
        )
        assert (plan.gathered_gb > 0) == (zero >= 2)
    weights, grads, adam = report[0]
    shards = {
        1: [weights, grads, adam / 4],
        2: [weights, grads / 4, adam / 4],
        3: [weights / 4, grads / 4, adam / 4],
    }
    for zero, want in shards.items():
        assert report[zero] == pytest.approx(want, abs=PRINTED_QUARTER_PAIR_ABS), zero
    # two micro-batches: gathers before each forward and backward, not once after the step
    assert payload[0] == 0 and payload[1] == payload[2] > 0 and payload[3] > 3 * payload[1]


def test_zero_outside_0_to_3_is_one_line():
    assert_check_fails_with_one_line(
        ["--config", str(CONFIGS / "tiny.yaml"), "--set", "optim.zero=4"], "optim.zero"
    )


def test_grad_reduce_dtype_other_than_fp32_or_bf16_is_one_line():
    assert_check_fails_with_one_line(
        ["--config", str(CONFIGS / "tiny.yaml"), "--set", "optim.grad_reduce_dtype=fp16"],
        "optim.grad_reduce_dtype",
    )
