"""LoRA against peft: from the same tiny Llama (checkpoint.init_from_hf) and the same adapter
initialization, a LoRA run (model.lora on every projection, the base frozen) follows the loss
curve and gradient norms of transformers + peft trained by torch.optim.AdamW (adapters
trainable, everything else frozen) on the same batches (tests/hf/curve.py), and the runs at
tp 2, at pp 2 and at dp 2 (ZeRO 1, 2, 3: the frozen base neither reduced nor sharded), and at
tp 2 and at pp 2 from the tp 1 run's checkpoint of step 10, equal the one at tp 1; the
collectives of the runs at tp 2 and at dp 2 (ZeRO-3's gathers of the adapters alone, the last
block's kept from its forward to its backward) are those `check` counts. All within the parity
harness's 1e-5 relative per step (tests/tolerances.py: the same fp32 arithmetic in another
order; the adapters add two GEMMs of at most 72 terms per projection, and Adam's normalized
update passes their rounding on unamplified). A tiny Qwen3-MoE with adapters on its experts (peft's
target_parameters experts.gate_up_proj and experts.down_proj) follows peft's curve too, and its
exports load in peft and transformers with our logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatronish import load_model
from megatronish.data import dataset_vocab_size
from megatronish.distributed.layout import ParallelState
from megatronish.moe.experts import stored_tensors
from tests.conftest import invoke_cli
from tests.hf.curve import (
    CURVE_STEPS,
    LLAMA_SHAPE,
    peft_reference,
    reference_curve,
    run_settings,
)
from tests.parity import LAYOUT_STEPS, assert_close, make_config, make_trainer, train_counted
from tests.ranks import run_on_ranks
from tests.tolerances import LAYOUT_CURVE_REL, PARITY_LOGITS_ABS

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(rank=4, alpha=8.0, targets=TARGETS)
ZERO_STEPS = 5
PP_STEPS = 3
BF16_STEPS = 3
RESUME_AT = 10
RESUMED_STEPS = 3  # the runs resharded from the checkpoint of step RESUME_AT train this many
LORA_SETTINGS = [
    f"model.lora.rank={LORA['rank']}",
    f"model.lora.alpha={LORA['alpha']}",
    f"model.lora.targets=[{','.join(TARGETS)}]",
]

TALLY_SETTINGS = [
    "model.lora.targets=[o_proj,up_proj,down_proj]",
    "parallel.sequence_parallel=true",
    "train.activation_checkpointing=full",
]


def tiny_llama(dataset: Path, path: Path) -> Path:
    """A tiny random Llama (fp32) on the dataset's vocabulary, saved with save_pretrained."""
    config = transformers.LlamaConfig(
        vocab_size=dataset_vocab_size(dataset), attn_implementation="eager", **LLAMA_SHAPE
    )
    with torch.random.fork_rng():
        torch.manual_seed(7)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(dataset, tmp_path_factory) -> Path:
    return tiny_llama(dataset, tmp_path_factory.mktemp("lora-curve") / "llama")


@pytest.fixture(scope="module")
def curves(hf_dir, dataset, tmp_path_factory) -> dict:
    """Our tp 1 LoRA run's curve (its checkpoint of step RESUME_AT kept) and peft's from our
    initial adapters, one thread each."""
    settings = run_settings(hf_dir) + LORA_SETTINGS
    saved = tmp_path_factory.mktemp("lora-ckpt")
    cfg = make_config(1, 1, 1, settings + [f"checkpoint.dir={saved}"], dataset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        model = trainer.model
        adapters = trained_adapters(model)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        losses, norms, _ = train_counted(trainer, CURVE_STEPS, save_every=RESUME_AT)
        theirs = peft_reference(hf_dir, LORA, adapters)
        decay = {name: True for name, _ in theirs.named_parameters()}  # the adapters' matrices
        ref_losses, ref_norms = reference_curve(theirs, decay, cfg, dataset)
    finally:
        torch.set_num_threads(threads)
    return dict(
        tp1={"losses": losses, "norms": norms},
        reference={"losses": ref_losses, "norms": ref_norms},
        adapters=adapters,
        frozen=frozen,
        settings=settings,
        saved=saved,
    )


@pytest.fixture(scope="module")
def layouts(curves, dataset) -> list[dict]:
    """Each rank's curves of the other layouts, in one 2-rank run."""
    settings, saved = curves["settings"], curves["saved"]
    # the first LAYOUT_STEPS at tp 2, where a layout that splits or reduces wrongly parts
    runs = {"tp2": (2, 1, 1, settings, LAYOUT_STEPS)}
    # the tp 1 checkpoint of step RESUME_AT (adapters, their AdamW state, the frozen base)
    # resharded to tp 2 and trained on
    resume = [f"checkpoint.resume={saved / f'step_{RESUME_AT:06d}'}", "checkpoint.save=false"]
    runs["tp2-resumed"] = (2, 1, 1, settings + resume, RESUME_AT + RESUMED_STEPS)
    # at pp 2: its first steps, and the same checkpoint resharded across pp
    runs["pp2"] = (1, 1, 2, settings, PP_STEPS)
    runs["pp2-resumed"] = (1, 1, 2, settings + resume, RESUME_AT + RESUMED_STEPS)
    # the first steps of the 20-step schedule: a ZeRO level that mishandles the frozen base
    # differs from the first step on
    for zero in (1, 2, 3):
        runs[f"dp2-zero{zero}"] = (1, 2, 1, settings + [f"optim.zero={zero}"], ZERO_STEPS)
    # one step for its collectives: no adapter on q, k, v or gate, under sequence parallelism
    # and full recompute (accounting.collectives.lora's cases)
    runs["tp2-sp-tally"] = (2, 1, 1, settings + TALLY_SETTINGS, 1)
    # and with the linear layers' collectives decomposed: the adapted ones gather whole
    overlap = ["parallel.sequence_parallel=true", "parallel.tp_comm_overlap=true"]
    runs["tp2-sp-overlap-tally"] = (2, 1, 1, settings + overlap, 1)
    # fp8 rowwise at cp 2: the frozen weights' gradient GEMMs, whose scales cp reduces, do not run
    fp8 = ["parallel.cp=2", "train.precision=fp8", "train.fp8_recipe=rowwise"]
    runs["cp2-fp8-tally"] = (1, 1, 1, settings + fp8, 1)
    return run_on_ranks(train_layouts, 2, runs, dataset, timeout=300)


def stored(model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors by their stored names (one per expert)."""
    named = stored_tensors(model.named_parameters())
    return [(name, p if j is None else p[j]) for name, p, j in named]


def trained_adapters(model) -> dict[str, torch.Tensor]:
    """The model's trained tensors by their stored names (one per expert), copied."""
    return {name: t.detach().clone() for name, t in stored(model) if t.requires_grad}


# A tiny Qwen3-MoE (transformers' fused experts) whose experts peft adapts by target_parameters.
MOE_SHAPE = dict(
    LLAMA_SHAPE,
    num_hidden_layers=2,
    head_dim=12,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
)
MOE_LORA = dict(rank=4, alpha=8.0, targets=["v_proj", "experts.gate_up_proj", "experts.down_proj"])


@pytest.fixture(scope="module")
def moe_curves(dataset, tmp_path_factory) -> dict:
    """Our tp 1 LoRA run of a tiny Qwen3-MoE with adapters on its experts (its checkpoint of
    the last step kept), and peft's curve from our initial adapters (its ParamWrapper on
    experts.gate_up_proj and down_proj)."""
    root = tmp_path_factory.mktemp("lora-moe")
    hf_dir = root / "qwen3-moe"
    config = transformers.Qwen3MoeConfig(
        vocab_size=dataset_vocab_size(dataset), attn_implementation="eager", **MOE_SHAPE
    )
    with torch.random.fork_rng():
        torch.manual_seed(7)
        transformers.Qwen3MoeForCausalLM(config).save_pretrained(hf_dir)
    targets = ",".join(MOE_LORA["targets"])
    settings = run_settings(hf_dir) + [
        f"model.lora.rank={MOE_LORA['rank']}",
        f"model.lora.alpha={MOE_LORA['alpha']}",
        f"model.lora.targets=[{targets}]",
    ]
    cfg = make_config(1, 1, 1, settings + [f"checkpoint.dir={root / 'ckpt'}"], dataset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        adapters = trained_adapters(trainer.model)
        losses, norms, _ = train_counted(trainer, CURVE_STEPS, save_every=CURVE_STEPS)
        theirs = peft_reference(hf_dir, MOE_LORA, adapters)
        decay = {name: True for name, _ in theirs.named_parameters()}
        ref_losses, ref_norms = reference_curve(theirs, decay, cfg, dataset)
    finally:
        torch.set_num_threads(threads)
    return dict(
        ours={"losses": losses, "norms": norms},
        reference={"losses": ref_losses, "norms": ref_norms},
        adapters=adapters,
        hf=hf_dir,
        root=root,
        settings=settings,
    )


def test_a_lora_run_on_the_experts_follows_the_peft_adamw_curve_at_tp1(moe_curves):
    reference, ours = moe_curves["reference"], moe_curves["ours"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.1  # the adapters learn
    assert any(".mlp.experts.3.gate_up.lora_A" in n for n in moe_curves["adapters"])
    assert_close(ours["losses"], reference["losses"], rel=LAYOUT_CURVE_REL, steps=CURVE_STEPS)
    assert_close(ours["norms"], reference["norms"], rel=LAYOUT_CURVE_REL, steps=CURVE_STEPS)


def test_the_experts_adapters_export_to_peft_and_merged_with_our_logits_and_come_back(
    moe_curves, dataset
):
    """`export --format peft` of the expert run loads in peft.PeftModel.from_pretrained with
    our logits, `--format hf --merge-lora` in transformers too, and checkpoint.init_lora_from
    of the peft export gives back the checkpoint's adapters."""
    root = moe_curves["root"]
    ckpt = root / "ckpt" / f"step_{CURVE_STEPS:06d}"
    for args in (["--format", "peft"], ["--format", "hf", "--merge-lora"]):
        out = str(root / args[1])
        result = invoke_cli("export", "--checkpoint", str(ckpt), "--output", out, *args)
        assert result.returncode == 0, result.stderr
    ours = load_model(ckpt)
    batch = torch.randint(0, ours.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ours(batch)
        base = transformers.AutoModelForCausalLM.from_pretrained(moe_curves["hf"]).eval()
        assert (base(batch).logits - expected).abs().max() > 100 * PARITY_LOGITS_ABS
        adapted = peft.PeftModel.from_pretrained(base, root / "peft").eval()
        merged = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
        for model in (adapted, merged):
            assert (model(batch).logits - expected).abs().max() <= PARITY_LOGITS_ABS
    sets = moe_curves["settings"] + [f"checkpoint.init_lora_from={root / 'peft'}"]
    trainer = make_trainer(make_config(1, 1, 1, sets, dataset), 1, dataset, ParallelState.single())
    saved = dict(stored(ours.gpt))
    for name, tensor in trained_adapters(trainer.model).items():
        assert torch.equal(tensor, saved[name]), name


def test_a_lora_run_follows_the_peft_adamw_curve_at_tp1(curves):
    reference, ours = curves["reference"], curves["tp1"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.1  # the adapters learn
    assert curves["frozen"] > 0 and all(
        n.endswith(("lora_A", "lora_B")) for n in curves["adapters"]
    )
    assert_close(ours["losses"], reference["losses"], rel=LAYOUT_CURVE_REL, steps=CURVE_STEPS)
    assert_close(ours["norms"], reference["norms"], rel=LAYOUT_CURVE_REL, steps=CURVE_STEPS)


def test_under_bf16_the_frozen_base_is_held_in_bf16_alone_and_trains_as_from_fp32_masters(
    curves, dataset
):
    """train.precision bf16: the frozen linear weights are bf16 parameters and nothing else
    holds them (no fp32 master: model.adapters.freeze_base), and the first steps are bitwise
    those of the same run whose frozen weights are fp32 masters that autocast casts to bf16 at
    each use, as before (the same bf16 values enter the same GEMMs)."""
    settings = curves["settings"] + ["train.precision=bf16"]
    runs = {}
    for masters in (False, True):
        cfg = make_config(1, 1, 1, settings, dataset)
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        params = list(trainer.model.parameters())
        held = [p for p in params if p.dtype == torch.bfloat16]
        assert held and not any(p.requires_grad for p in held)
        assert all(p.dtype == torch.float32 for p in params if p.requires_grad)
        for param in held if masters else []:
            param.data = param.data.float()
        runs[masters] = train_counted(trainer, BF16_STEPS)[:2]
    assert runs[False] == runs[True]


@pytest.mark.slow  # a 2-rank run
@pytest.mark.parametrize(
    "layout", ["tp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2-resumed", "pp2", "pp2-resumed"]
)
def test_a_lora_run_at_tp2_pp2_or_dp2_at_every_zero_level_equals_the_run_at_tp1(
    curves, layouts, layout
):
    for ranks in layouts:
        for key in ("losses", "norms"):
            ours = ranks[layout][key]
            start = RESUME_AT if layout.endswith("resumed") else 0
            tp1 = curves["tp1"][key][start : start + len(ours)]
            assert_close(ours, tp1, rel=LAYOUT_CURVE_REL, steps=len(tp1))


@pytest.mark.slow  # a 2-rank run
@pytest.mark.parametrize(
    "layout",
    ["tp2", "tp2-sp-tally", "tp2-sp-overlap-tally", "cp2-fp8-tally"]
    + ["dp2-zero1", "dp2-zero2", "dp2-zero3"],
)
def test_check_counts_the_collectives_a_lora_run_makes_at_tp2_and_at_dp2_at_every_zero_level(
    layouts, layout
):
    for ranks in layouts:
        assert ranks[layout]["payload"] == ranks[layout]["formula"]


@pytest.mark.slow  # a 2-rank run
@pytest.mark.parametrize("layout", ["tp2", "tp2-sp-tally", "tp2-sp-overlap-tally"])
def test_no_frozen_weight_gets_a_weight_gradient_gemm_at_tp2(layouts, layout):
    """The linear layers' own backward passes (every frozen layer's at tp 2, the adapters'
    being autograd's) compute no weight gradient: layers.formats' GEMM for one never runs."""
    for ranks in layouts:
        assert ranks[layout]["weight_gemms"] == 0


def train_layouts(rank: int, world: int, runs: dict, dataset: Path) -> dict[str, dict]:
    """The losses, gradient norms, first step's collective payloads (counted, and as accounting
    counts them) and the layers' weight-gradient GEMMs of each run {name: (tp, dp, pp, settings,
    steps to train)} on these ranks."""
    from megatronish.accounting.collectives import formula_payload_by_kind
    from megatronish.layers.formats import HighPrecision

    gemms, plain = [], HighPrecision.grad_weight

    def counted(self, *args):
        gemms.append(1)
        return plain(self, *args)

    curves = {}
    HighPrecision.grad_weight = counted  # the weight-gradient GEMMs the layers' backward makes
    try:
        for name, (tp, dp, pp, settings, steps) in runs.items():
            cfg = make_config(tp, dp, pp, settings, dataset)
            trainer = make_trainer(cfg, world, dataset)
            gemms.clear()
            losses, norms, counter = train_counted(trainer, steps)
            formula = formula_payload_by_kind(cfg, trainer.setup.derived, trainer.ps.pp_rank)
            curves[name] = {"losses": losses, "norms": norms, "weight_gemms": len(gemms)}
            curves[name] |= {"payload": dict(counter.payload_bytes), "formula": formula}
    finally:
        HighPrecision.grad_weight = plain
    return curves
