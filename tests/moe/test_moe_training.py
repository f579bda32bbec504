"""Mixture of experts in training: the first LAYOUT_STEPS fp32 dropless steps at ep = 2 (also with
a shared expert and the top-k-then-softmax router; all STEPS for the run that saves), ep 2 x tp
2, ep 2 x pp 2, ep 2 x cp 2, dp 4 x ep 2 with ZeRO-1, and dp = 2 at ep = 1 give the losses,
gradient norms and router metrics (balancing and z-losses, imbalance) of one process within 1e-5
relative; so does DeepSeek-V3's MoE (sigmoid router in groups, routing biases moved every step,
sequence-wise loss, shared experts, a dense first block, a MoE multi-token prediction block) at
dp 2 x ep 2 with full recompute, tp 2 x dp 2 x ep 2 with sequence parallelism, and pp 2 x cp 2
with ZeRO-1 over the cp group, its routing biases within 1e-6 (ZeRO-2 and 3:
tests/data_parallel/test_zero_levels.py); with a capacity factor the dropped fraction does not
change with ep, nor with tp under sequence parallelism, and the one metrics.jsonl reports equals
a count made outside the model on the same router output; an ep = 2 checkpoint resumes at ep = 1
on the same curve and loads, evaluates and generates in one process (a LoRA run's with adapters
on the experts, trained as one process trains it at ep 2, and under ZeRO-3, whose gathers (of
the adapters alone) are those `check` counts, at ep 2 x tp 2 with sequence parallelism and at
dp 4 x ep 2, resumes so too); one-process training is deterministic; bad MoE settings exit 2
with one line. With the experts (and a shared expert) in fp8, fp32 around them, the first FP8_STEPS
steps' losses, gradient norms and router metrics at ep 2 (tensorwise, rowwise, blockwise with
capacity drops, and GPT-OSS's biased experts behind the clamped SwiGLU, rowwise), tp 2 x dp 2 x
ep 2 with sequence parallelism (tensorwise, rowwise) and cp 2 x ep 2 (tensorwise) equal one
process's to 1e-5: an expert's scales are per (expert, source) run of rows, reduced over the cp
ranks, as one process scales a micro-batch's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, invoke_cli
from tests.moe.layouts import (
    DEEPSEEK,
    FOUR_RANKS,
    FP8_STEPS,
    MOE,
    TWO_RANKS,
)
from tests.parity import (
    LAYOUT_STEPS,
    SAVE_AT,
    STEPS,
    assert_check_fails_with_one_line,
    assert_close,
    assert_curves_match,
    make_trainer,
    prepare_code_dataset,
    train_counted,
    train_losses,
)
from tests.parity import make_config as parity_config
from tests.ranks import run_on_ranks
from tests.tolerances import (
    EXACT,
    FP32_TINY_ABS,
    FP64_REORDER,
    LAYOUT_CURVE_REL,
    PARITY_ABS,
    PARITY_REL,
)

pytestmark = pytest.mark.slow  # multi-rank MoE training at every layout

SAVED = "ep2"  # also saves a checkpoint at step SAVE_AT
SAVED_LORA = "ep2 lora experts"  # and in save_dir / "lora"
ROUTER_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_imbalance", "moe_dropped_frac")
BIAS_METRICS = ("moe_load_spread", "moe_load_spread_mean", "moe_bias_range")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Ten documents like the session's `dataset` (tests/conftest.py), which this module's
    fixture overrides, of other functions: the data these MoE curves have always trained on."""
    function = "def h{i}(y):\n    return y * {i} + {part}\n\n"
    return prepare_code_dataset(tmp_path_factory.mktemp("moe-data"), function)


def make_config(tp, cp, dp, pp, ep, overrides, dataset, extra=()):
    """The parity config (tests/parity.py) at this layout, in the variants' order."""
    return parity_config(tp, dp, pp, overrides, dataset, extra, cp=cp, ep=ep)


def _train(cfg, world, dataset, ps=None, save_every=0, steps: int | None = None) -> dict:
    """Losses and grad norms of `steps` steps (default train.steps), the router metrics and
    routing biases after the first LAYOUT_STEPS of them (all, when fewer), the payload of the
    first step and its analytic count."""
    from megatronish.accounting.collectives import formula_payload_by_kind

    trainer = make_trainer(cfg, world, dataset, ps)
    steps = steps or cfg.train.steps
    losses, norms, counter = train_counted(trainer, min(LAYOUT_STEPS, steps), save_every)
    result = {
        "metrics": trainer.moe_metrics(),  # over those steps
        "biases": {
            i: m.router.bias.tolist()
            for i, m in trainer.model.moe_layers().items()
            if m.router.bias is not None
        },
        "payload": dict(counter.payload_bytes),
        "formula": formula_payload_by_kind(cfg, trainer.setup.derived, trainer.ps.pp_rank),
    }
    if trainer.step < steps:
        more_losses, more_norms, _ = train_counted(trainer, steps, save_every)
        losses, norms = losses + more_losses, norms + more_norms
    return {"losses": losses, "norms": norms, **result}


def steps_of(name: str) -> int:
    """The steps a layout's run is held to: all of the reference's for the run that saves,
    else LAYOUT_STEPS."""
    return STEPS if name == SAVED else LAYOUT_STEPS


def _train_on_ranks(rank, world, variants, dataset, save_dir):
    results = {}
    for name, variant in variants.items():
        extra = []
        saved = {SAVED: save_dir, SAVED_LORA: save_dir / "lora"}.get(name)
        if saved is not None:
            extra = ["checkpoint.save=true", f"checkpoint.dir={saved}"]
        cfg = make_config(*variant, dataset, extra)
        steps = min(steps_of(name), cfg.train.steps)
        save_every = SAVE_AT if saved else 0
        results[name] = _train(cfg, world, dataset, save_every=save_every, steps=steps)
    return results


_REFERENCES: dict = {}
# Settings that change nothing in one process: ZeRO, sequence parallelism, recompute.
ONE_RANK_NO_OPS = ("optim.", "parallel.sequence_parallel", "train.activation_checkpointing")


def reference(overrides: list[str], dataset: Path) -> dict:
    """The one-rank run of these model settings (cached; ONE_RANK_NO_OPS left out)."""
    from megatronish.distributed.layout import ParallelState

    key = (tuple(o for o in overrides if not o.startswith(ONE_RANK_NO_OPS)), dataset)
    if key not in _REFERENCES:
        cfg = make_config(1, 1, 1, 1, 1, list(key[0]), dataset)
        _REFERENCES[key] = _train(cfg, 1, dataset, ParallelState.single())
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ep2-ckpt")


@pytest.fixture(scope="module")
def two_ranks(dataset, save_dir):
    return run_on_ranks(_train_on_ranks, 2, TWO_RANKS, dataset, save_dir, timeout=300)


@pytest.fixture(scope="module")
def four_ranks(dataset, save_dir):
    return run_on_ranks(_train_on_ranks, 4, FOUR_RANKS, dataset, save_dir, timeout=300)


def assert_router_metrics_match(per_rank: list[dict], name: str, ref: dict) -> None:
    """The router metrics; with routing biases, the biases and the last step's load spread,
    after the first LAYOUT_STEPS steps (FP8_STEPS in fp8)."""
    for rank_results in per_rank:
        got = rank_results[name]["metrics"]
        for key in ROUTER_METRICS + tuple(k for k in BIAS_METRICS if k in ref["metrics"]):
            assert got[key] == pytest.approx(
                ref["metrics"][key], rel=LAYOUT_CURVE_REL, abs=FP32_TINY_ABS
            ), key
        for index, bias in rank_results[name]["biases"].items():
            assert bias == pytest.approx(ref["biases"][index], rel=EXACT, abs=EXACT), index


@pytest.mark.parametrize("name", [name for name in TWO_RANKS if "fp8" not in name])
def test_moe_at_two_ranks_losses_norms_and_router_metrics_equal_one_process(
    name, two_ranks, dataset
):
    ref = reference(TWO_RANKS[name][-1], dataset)
    learned = 0.2 if "lora" in name else 0.5  # the adapters alone learn more slowly
    assert ref["losses"][-1] < ref["losses"][0] - learned  # the runs really learn
    assert_curves_match(two_ranks, name, ref, steps_of(name))
    assert_router_metrics_match(two_ranks, name, ref)
    if name == "ep2 capacity":
        assert ref["metrics"]["moe_dropped_frac"] > 0
    else:
        assert ref["metrics"]["moe_dropped_frac"] == 0


@pytest.mark.parametrize("name", [name for name in FOUR_RANKS if "fp8" not in name])
def test_moe_with_tp_pp_cp_zero_losses_norms_and_router_metrics_equal_one_process(
    name, four_ranks, dataset
):
    ref = reference(FOUR_RANKS[name][-1], dataset)
    assert_curves_match(four_ranks, name, ref, steps_of(name))
    assert_router_metrics_match(four_ranks, name, ref)
    if "deepseek" in name:  # the multi-token prediction block (index n_layer = 2) balances too
        assert ref["biases"][2] != [0.0] * 8


FP8_VARIANTS = [
    (ranks, name)
    for ranks, variants in (("two", TWO_RANKS), ("four", FOUR_RANKS))
    for name in variants
    if "fp8" in name
]


@pytest.mark.parametrize(("ranks", "name"), FP8_VARIANTS)
def test_fp8_experts_first_steps_at_ep2_tp2_dp2_ep2_and_cp2_ep2_equal_one_process(
    two_ranks, four_ranks, dataset, ranks, name
):
    per_rank = two_ranks if ranks == "two" else four_ranks
    variant = {**TWO_RANKS, **FOUR_RANKS}[name]
    ref = reference(variant[-1], dataset)
    for rank_results in per_rank:
        for key in ("losses", "norms"):
            assert_close(rank_results[name][key], ref[key], steps=FP8_STEPS)
    assert_router_metrics_match(per_rank, name, ref)
    assert (ref["metrics"]["moe_dropped_frac"] > 0) == ("capacity" in name)


def test_every_rank_sends_the_payload_the_analytic_count_gives_all_to_all_included(
    two_ranks, four_ranks
):
    """Per rank for every kind but all_to_all, whose returned rows depend on the routing:
    its sum over the ranks (dropless); so too the all-reduces of the rowwise fp8 experts at
    tp 2, whose per-row amaxes are of the rows a rank received."""
    for per_rank in (two_ranks, four_ranks):
        for name in per_rank[0]:
            tp, ep = {**TWO_RANKS, **FOUR_RANKS}[name][0], {**TWO_RANKS, **FOUR_RANKS}[name][4]
            routed = (
                ("all_to_all", "all_reduce") if "rowwise" in name and tp > 1 else ("all_to_all",)
            )
            results = [rank_results[name] for rank_results in per_rank]
            for result in results:
                assert ("all_to_all" in result["payload"]) == (ep > 1), name
                measured = {k: v for k, v in result["payload"].items() if k not in routed}
                assert measured == {k: v for k, v in result["formula"].items() if k not in routed}
            if "capacity" not in name:
                for kind in routed:
                    total = sum(r["payload"].get(kind, 0) for r in results)
                    assert total == sum(r["formula"].get(kind, 0) for r in results), (name, kind)


def test_one_process_moe_training_is_deterministic(dataset):
    from megatronish.distributed.layout import ParallelState

    first = reference(MOE, dataset)
    cfg = make_config(1, 1, 1, 1, 1, MOE, dataset)
    again = _train(cfg, 1, dataset, ParallelState.single())
    assert again["losses"] == first["losses"] and again["norms"] == first["norms"]


def test_an_ep2_checkpoint_resumes_at_ep1_on_the_same_curve_and_loads_evaluates_generates(
    two_ranks, dataset, save_dir
):
    import torch

    from megatronish import load_model
    from megatronish.distributed.layout import ParallelState

    ref = reference(MOE, dataset)
    extra = [f"checkpoint.resume={save_dir}/step_{SAVE_AT:06d}", "checkpoint.save=false"]
    cfg = make_config(1, 1, 1, 1, 1, MOE, dataset, extra)
    trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
    assert trainer.resumed_from == SAVE_AT
    assert_close(train_losses(trainer), ref["losses"][SAVE_AT:], steps=STEPS - SAVE_AT)
    # The ep = 2 run's step 20 in one process: the logits of the ep = 1 continuation.
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(tokens)[..., : trainer.setup.derived.vocab_size]
        got = load_model(save_dir / f"step_{STEPS:06d}")(tokens)
    torch.testing.assert_close(got, want, rtol=PARITY_REL, atol=PARITY_ABS)
    last = str(save_dir / f"step_{STEPS:06d}")
    assert invoke_cli("eval", "--checkpoint", last).returncode == 0
    generated = invoke_cli("generate", "--checkpoint", last, "--prompt", "def", "--seed", "1",
                           "--max-new-tokens", "8")  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    saved = json.loads((save_dir / f"step_{SAVE_AT:06d}" / "metadata.json").read_text())
    assert saved["layout"]["ep"] == 2
    assert "blocks.0.mlp.experts.3.down.weight" in saved["tensors"]
    assert "model_tp00_ep01.safetensors" in saved["files"]


def test_an_ep2_lora_checkpoint_resumes_at_ep1_on_the_same_curve(two_ranks, dataset, save_dir):
    """The experts' adapters and their AdamW state, saved by global expert id at ep 2, resharded
    to one process: the remaining steps are the one-process run's."""
    from megatronish.distributed.layout import ParallelState

    overrides = TWO_RANKS[SAVED_LORA][-1]
    ref = reference(overrides, dataset)
    step = save_dir / "lora" / f"step_{SAVE_AT:06d}"
    extra = [f"checkpoint.resume={step}", "checkpoint.save=false"]
    trainer = make_trainer(
        make_config(1, 1, 1, 1, 1, overrides, dataset, extra), 1, dataset, ParallelState.single()
    )
    assert trainer.resumed_from == SAVE_AT
    assert_close(train_losses(trainer), ref["losses"][SAVE_AT:], steps=STEPS - SAVE_AT)
    saved = json.loads((step / "metadata.json").read_text())
    assert "blocks.1.mlp.experts.3.gate_up.lora_A" in saved["tensors"]


def test_metrics_dropped_fraction_equals_a_count_outside_the_model(dataset, tmp_path, monkeypatch):
    """A one-process run with a capacity factor logs moe_dropped_frac every step; the router's
    choices, recorded as the model makes them, give the same fraction counted here."""
    from megatronish.distributed.layout import ParallelState
    from megatronish.moe import layer

    routed = []

    def recording_route(logits, top_k, kind, *settings):
        routing = route(logits, top_k, kind, *settings)
        routed.append(routing.experts.tolist())
        return routing

    route = layer.route
    monkeypatch.setattr(layer, "route", recording_route)
    steps, out = 3, tmp_path / "run"
    extra = [f"train.steps={steps}", "train.log_every=1", f"run.out_dir={out}"]
    cfg = make_config(1, 1, 1, 1, 1, MOE + ["model.moe.capacity_factor=0.75"], dataset, extra)
    make_trainer(cfg, 1, dataset, ParallelState.single()).run()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = len(routed) // steps  # MoE layers x micro-batches
    for step, line in enumerate(logged):
        dropped = total = 0
        for choices in routed[step * per_step : (step + 1) * per_step]:
            capacity = math.ceil(0.75 * len(choices) * 2 / 4)
            taken = [0] * 4
            for slot in range(2):  # first choices first, in token order
                for token in choices:
                    taken[token[slot]] += 1
                    dropped += taken[token[slot]] > capacity
            total += 2 * len(choices)
        assert line["moe_dropped_frac"] == pytest.approx(dropped / total, abs=FP64_REORDER)
        assert dropped > 0


@pytest.mark.parametrize(
    ("world", "sets", "key"),
    [
        (1, ["model.moe.top_k=5"], "model.moe.top_k"),
        (2, ["model.moe.num_experts=6", "parallel.ep=4"], "model.moe.num_experts"),
        (2, ["parallel.ep=4"], "parallel.ep"),
        (1, ["model.moe.num_experts=0", "parallel.ep=2"], "parallel.ep"),
        (1, ["model.arch=gpt2", "model.n_kv_head=null"], "model.moe"),
        (1, ["model.moe.capacity_factor=0"], "model.moe.capacity_factor"),
        (1, ["model.moe.router=sigmoid", "model.moe.bias_update_speed=-1"], "bias_update_speed"),
        (1, ["model.moe.router=sigmoid", "model.moe.n_group=3"], "model.moe.n_group"),
        (
            1,
            ["model.moe.router=sigmoid", "model.moe.n_group=2", "model.moe.topk_group=3"],
            "model.moe.topk_group",
        ),
        (
            1,
            ["model.moe.router=sigmoid", "model.moe.n_group=2", "model.moe.top_k=3"],
            "model.moe.top_k",
        ),
        (1, ["model.moe.n_group=2"], "model.moe.n_group"),
    ],
)
def test_cli_bad_moe_settings_exit_2_with_one_line(world, sets, key):
    args = ["--config", str(CONFIGS / "tiny.yaml"), "--world-size", str(world)]
    for s in [*MOE, "model.moe.num_experts=4", *sets]:
        args += ["--set", s]
    assert_check_fails_with_one_line(args, key)


def test_check_and_plan_count_total_active_and_per_rank_expert_parameters():
    from megatronish.accounting.flops import model_flops_per_step
    from megatronish.accounting.memory import estimate
    from megatronish.accounting.parameters import parameter_count
    from megatronish.commands.check import check_config
    from megatronish.config import derive, load_config
    from megatronish.distributed.layout import ParallelState
    from megatronish.model import GPT

    sets = ["model.vocab_size=256", "model.moe.shared_expert=true", "parallel.dp=2"]
    cfg = load_config(CONFIGS / "tiny-moe.yaml", sets)
    d = derive(cfg, 2)
    built = sum(p.numel() for p in GPT(cfg, d, ParallelState.single()).parameters())
    assert parameter_count(cfg, d) == built  # vocab 256 needs no padding
    h, f, layers = cfg.model.d_model, d.moe_d_ff, len(d.moe_layers)
    assert parameter_count(cfg, d) - parameter_count(cfg, d, active=True) == layers * 6 * 3 * h * f
    top1 = load_config(CONFIGS / "tiny-moe.yaml", [*sets, "model.moe.top_k=1"])
    tokens = d.tokens_per_step
    assert model_flops_per_step(cfg, d) - model_flops_per_step(top1, derive(top1, 2)) == (
        6 * layers * 3 * h * f * tokens
    )
    # DeepSeek-V3's multi-token prediction block is a MoE block too (its router's bias is
    # state, not counted).
    deep = load_config(None, [*DEEPSEEK, "model.vocab_size=256"])
    d_deep = derive(deep, 1)
    model = GPT(deep, d_deep, ParallelState.single())
    assert sorted(model.moe_layers()) == list(d_deep.moe_layers) == [1, 2]
    biases = sum(layer.router.bias.numel() for layer in model.moe_layers().values())
    assert parameter_count(deep, d_deep) == sum(p.numel() for p in model.parameters()) - biases
    report = check_config(load_config(CONFIGS / "tiny-moe.yaml", [*sets, "parallel.ep=2"]), None)
    assert "experts per ep rank: 4 (ep 2)" in report
    assert "all-to-all per step and rank (ep 2)" in report
    ep1, ep2 = (estimate(cfg, 2, 1, ep=ep) for ep in (1, 2))
    assert ep2.expert_gb == pytest.approx(ep1.expert_gb / 2)


def test_check_reports_the_all_to_all_of_a_stage_with_moe_layers_and_names_it():
    """At pp 2 with the first two of four blocks dense, stage 0 has no MoE layer: check reports
    stage 1's all-to-all."""
    from megatronish.accounting.collectives import collectives_per_step
    from megatronish.commands.check import check_config
    from megatronish.config import derive, load_config

    sets = ["model.vocab_size=257", "model.moe.first_k_dense=2", "parallel.pp=2"]
    cfg = load_config(CONFIGS / "tiny-deepseek-v3.yaml", [*sets, "parallel.dp=2", "parallel.ep=2"])
    a2a = [op for op in collectives_per_step(cfg, derive(cfg, 4), 1) if op.kind == "all_to_all"]
    payload = sum(op.payload * op.count for op in a2a) / 2**20
    line = f"all-to-all per step and rank (ep 2, stage 1: 2 MoE layers): {payload:.2f} MiB payload"
    assert payload > 0 and line in check_config(cfg, None)


def test_a_resumed_run_restores_the_routing_biases_exactly_and_continues_on_the_same_curve(
    dataset, tmp_path
):
    """A one-process DeepSeek run saved at step 2 resumes to step 4 with the biases and losses
    of the uninterrupted run, bit for bit; load_model gets the saved biases too."""
    from megatronish import load_model
    from megatronish.distributed.layout import ParallelState

    def biases(model) -> list[list[float]]:
        return [layer.router.bias.tolist() for layer in model.moe_layers().values()]

    save = ["train.steps=4", "checkpoint.save=true", f"checkpoint.dir={tmp_path}"]
    cfg = make_config(1, 1, 1, 1, 1, DEEPSEEK, dataset, save)
    whole = make_trainer(cfg, 1, dataset, ParallelState.single())
    losses, _, _ = train_counted(whole, 4, save_every=2)
    assert any(b != 0 for layer in biases(whole.model) for b in layer)
    resume = [*save, f"checkpoint.resume={tmp_path}/step_000002", "checkpoint.save=false"]
    cfg = make_config(1, 1, 1, 1, 1, DEEPSEEK, dataset, resume)
    resumed = make_trainer(cfg, 1, dataset, ParallelState.single())
    assert biases(resumed.model) == biases(load_model(tmp_path / "step_000002").gpt)
    assert train_losses(resumed) == losses[2:]
    assert biases(resumed.model) == biases(whole.model)
