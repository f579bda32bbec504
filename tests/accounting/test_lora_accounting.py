"""A LoRA run's accounting: plan's model state counts the frozen base as weights alone and the
adapters' gradients and AdamW state, and check's data-parallel gradient reduction sends the
adapters' gradients alone; the adapter count is the built model's."""

from __future__ import annotations

import pytest
import torch

from megatronish.accounting.collectives import collectives_per_step
from megatronish.accounting.lora import adapter_counts, bf16_held_weights
from megatronish.accounting.model_state import model_state_bytes
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from tests.conftest import CONFIGS
from tests.tolerances import FP64_REORDER

TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
SETTINGS = ["model.n_layer=2", "model.vocab_size=257"]
LORA = ["model.lora.rank=4", f"model.lora.targets={TARGETS}"]


def config(extra: list[str], world: int = 1):
    cfg = load_config(CONFIGS / "tiny-qwen3.yaml", SETTINGS + extra)
    return cfg, derive(cfg, world, vocab_size=257)


def test_the_adapter_count_is_the_built_models_trainable_parameters():
    cfg, derived = config(LORA)
    model = GPT(cfg, derived, ParallelState.single())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_counts(cfg, derived) == (trained, 0)


def test_plan_counts_the_frozen_base_as_weights_without_gradients_or_optimizer_state():
    cfg, derived = config(LORA)
    base_cfg, base_derived = config([])
    adapters, _ = adapter_counts(cfg, derived)
    lora, base = model_state_bytes(cfg, derived, 0), model_state_bytes(base_cfg, base_derived, 0)
    assert lora["grads"] == 4 * adapters and lora["optimizer"] == 8 * adapters
    assert lora["weights"] == base["weights"] + 4 * adapters


def test_check_counts_the_data_parallel_reduction_of_the_adapters_alone():
    cfg, derived = config(LORA + ["parallel.dp=2"], world=2)
    adapters, _ = adapter_counts(cfg, derived)
    (reduction,) = [
        op for op in collectives_per_step(cfg, derived) if op.what.startswith("data-parallel")
    ]
    assert reduction.payload == 4 * adapters


@pytest.mark.parametrize(
    "experts, precision",
    [(False, "fp32"), (False, "bf16"), (True, "fp32")],
    ids=["dense-fp32", "dense-bf16", "experts-fp32"],
)
def test_plan_holds_the_measured_state_of_a_running_lora_model(dataset, experts, precision):
    """After a step of a tiny LoRA llama (and one with experts and adapters on them), the
    distinct storages of its parameters, gradients and AdamW state are plan's weights + grads +
    optimizer state, and AdamW's step counts (an fp32 scalar a trained tensor, which plan leaves
    out), less (bf16) the bf16 copies autocast makes during a step of the weights held in fp32
    (plan counts them; the frozen linear weights are held in bf16 alone, so they have none)."""
    from tests.data_parallel.test_zero_levels import _held_bytes
    from tests.moe.layouts import LORA as MOE_LORA
    from tests.moe.layouts import MOE
    from tests.parity import LLAMA, make_config, make_trainer

    model = MOE + MOE_LORA if experts else LLAMA + LORA
    cfg = make_config(1, 1, 1, model + [f"train.precision={precision}"], dataset)
    trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
    trainer.train_step()
    derived = trainer.setup.derived
    state = model_state_bytes(cfg, derived, 0)
    params = list(trainer.model.parameters())
    trained = sum(p.requires_grad for p in params)
    held, _ = bf16_held_weights(cfg, derived)
    in_bf16 = sum(p.numel() for p in params if p.dtype == torch.bfloat16)
    assert in_bf16 == held and (held > 0) == (precision == "bf16")
    assert not any(p.requires_grad for p in params if p.dtype == torch.bfloat16)
    copies = 2 * (sum(p.numel() for p in params) - held) if precision == "bf16" else 0
    planned = state["weights"] + state["grads"] + state["optimizer"] + 4 * trained
    assert _held_bytes(trainer) == planned - copies


def test_a_lora_fine_tune_of_llama3_8b_fits_one_80gb_gpu_where_a_full_one_does_not():
    """configs/llama3-8b.yaml on one GPU with full recompute: the frozen base is its linear
    layers' weights in bf16 alone (2 bytes a parameter) and the rest (embeddings, norms) in fp32
    with their bf16 copies (6 bytes), the rank-16 adapters on every
    projection add their gradients and AdamW moments; without LoRA the model state alone (16
    bytes a parameter) passes 80 GB."""
    from megatronish.accounting.memory import estimate
    from megatronish.accounting.parameters import local_parameter_count

    sets = ["parallel.tp=1", "parallel.dp=1", "train.activation_checkpointing=full"]
    lora = ["model.lora.rank=16", f"model.lora.targets={TARGETS}"]
    cfg = load_config(CONFIGS / "llama3-8b.yaml", sets + lora)
    full = load_config(CONFIGS / "llama3-8b.yaml", sets)
    derived = derive(cfg, 1)
    adapters, _ = adapter_counts(cfg, derived)
    base = local_parameter_count(full, derive(full, 1))
    assert 8.0e9 < base < 8.1e9 and 40e6 < adapters < 43e6  # peft's count at r 16: 41.9M
    plan, whole = estimate(cfg, 1, 1), estimate(full, 1, 1)
    gib = 2**30
    held, _ = bf16_held_weights(cfg, derived)
    embedding = 128256 * 4096  # the token embedding's; the output layer's is held
    assert base - embedding - held == 32 * 2 * 4096 + 4096  # the norms
    assert plan.weights_gb * gib == 6 * (base + adapters) - 4 * held
    assert plan.weights_gb < 18.5  # 2 bytes a linear weight, 6 the embeddings'
    assert (plan.grads_gb * gib, plan.optimizer_gb * gib) == (4 * adapters, 8 * adapters)
    assert plan.total_gb < 80 < (whole.weights_gb + whole.grads_gb + whole.optimizer_gb)


def test_under_fp8_only_the_frozen_base_is_cast_and_plan_counts_its_casts():
    """A LoRA model under fp8 keeps the fp8 casts of its base layers' weights alone, the
    adapters getting bf16 copies as the norms do: forward's, and the input gradient's but for
    the first block's qkv (its input needs no gradient: accounting.lora.frozen_inputs), and
    plan's weights say so."""
    from megatronish.accounting.lora import frozen_input_casts
    from megatronish.accounting.model_state import fp8_layer_params
    from megatronish.fp8 import gemm
    from megatronish.model.precision import autocast
    from megatronish.objectives.registry import sequence_losses

    cfg, derived = config(LORA + ["train.precision=fp8"])
    model = GPT(cfg, derived, ParallelState.single())
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with gemm.weights_fixed():
        with autocast(cfg, torch.device("cpu")):
            loss = sequence_losses(model, tokens, tokens).total
        loss.backward()
        casts = gemm._WEIGHT_CASTS.values()
        kept = [q for made_by in casts for _, made in made_by.values() for q in made]
        payload = sum(q.payload.numel() * q.payload.element_size() for q in kept)
    base, qkv = fp8_layer_params(cfg, derived, 0), model.blocks["0"].attn.qkv.weight.numel()
    assert frozen_input_casts(cfg, derived) == qkv
    assert payload == 2 * base - qkv > 0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() for p in model.parameters())
    copies = 2 * (everything - base)  # bf16 autocast's, of all but the fp8 layers' weights
    held, held_fp8 = bf16_held_weights(cfg, derived)  # bf16 alone: 2 bytes, not 4
    in_bf16 = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    assert in_bf16 == held and held_fp8 > 0
    weights = 4 * everything + copies + payload - 2 * held_fp8 - 4 * (held - held_fp8)
    assert model_state_bytes(cfg, derived, 0)["weights"] == weights


EXPERT_LORA = [
    "model.lora.rank=4",
    "model.lora.targets=[q_proj,experts.gate_up_proj,experts.down_proj]",
]


def moe_config(extra: list[str], world: int = 1):
    cfg = load_config(CONFIGS / "tiny-qwen3-moe.yaml", SETTINGS + EXPERT_LORA + extra)
    return cfg, derive(cfg, world, vocab_size=257)


def test_the_expert_adapter_count_is_the_built_models_trainable_expert_parameters():
    from megatronish.accounting.lora import expert_adapter_counts
    from megatronish.layers.roles import is_expert

    cfg, derived = moe_config([])
    model = GPT(cfg, derived, ParallelState.single())
    trained = [p for p in model.parameters() if p.requires_grad]
    experts = sum(p.numel() for p in trained if is_expert(p))
    assert expert_adapter_counts(cfg, derived) == (experts, 0) and experts > 0
    assert adapter_counts(cfg, derived) == (sum(p.numel() for p in trained), 0)


def test_check_reduces_the_expert_adapters_over_the_expert_data_parallel_group_alone():
    from megatronish.accounting.lora import expert_adapter_counts

    settings = ["parallel.dp=4", "parallel.ep=2", "train.micro_batch_size=4"]
    cfg, derived = moe_config(settings, world=4)
    experts, _ = expert_adapter_counts(cfg, derived)
    dense = adapter_counts(cfg, derived)[0] - experts
    reductions = {
        (op.what, op.size): op.payload
        for op in collectives_per_step(cfg, derived)
        if op.purpose.name == "GRADIENT_REDUCTION"
    }
    assert experts > 0 and reductions == {
        ("data-parallel gradient average", 4): 4 * dense,
        ("expert gradient sum (expert-data-parallel)", 2): 4 * experts,
    }


def test_a_lora_steps_flops_are_the_ones_it_does_without_the_frozen_weight_gradients():
    """MFU's FLOPs under model.lora (accounting.flops): the adapters' GEMMs forward and
    backward (6 per adapter parameter and token, their count the built model's) and no weight
    gradient for the frozen matmul weights (2 per parameter and token fewer than the base)."""
    from megatronish.accounting.flops import matmul_params, model_flops_per_step
    from megatronish.accounting.lora import adapter_parameters

    cfg, derived = config(LORA)
    base_cfg, base_derived = config([])
    adapters = adapter_parameters(cfg, derived)
    assert adapters == adapter_counts(cfg, derived)[0] > 0  # tp 1: the built model's
    tokens, frozen = derived.tokens_per_step, matmul_params(base_cfg, base_derived)
    base = model_flops_per_step(base_cfg, base_derived)
    assert model_flops_per_step(cfg, derived) == base + (6 * adapters - 2 * frozen) * tokens


def test_a_lora_layers_backward_times_its_input_gradient_gemms_alone():
    """plan's step time (accounting.layer_time): a LoRA layer's backward is the base layer's
    without the frozen weights' gradient GEMMs, each timed as the roofline times it."""
    from megatronish.accounting.components import ATTENTION, mlp
    from megatronish.accounting.hardware import device_named
    from megatronish.accounting.layer_time import layer_time
    from megatronish.accounting.roofline import GPU_EFFICIENCY, gemm_time

    device = device_named("H100")
    cfg, derived = config(LORA + ["train.precision=bf16"])
    base_cfg, base_derived = config(["train.precision=bf16"])
    T = cfg.train.micro_batch_size * cfg.train.seq_len
    model = cfg.model
    gemms = ATTENTION[model.components.attention].gemms(model, derived, T, T)
    gemms += mlp.gemms(model, T, derived.d_ff)
    weight_grads = sum(gemm_time(k, n, m, device, 2, GPU_EFFICIENCY, False)[0] for m, n, k in gemms)
    times = [
        layer_time(c, d, device, GPU_EFFICIENCY, False, "flash")
        for c, d in ((cfg, derived), (base_cfg, base_derived))
    ]
    assert times[0].forward == times[1].forward
    assert times[0].backward == pytest.approx(times[1].backward - weight_grads, rel=FP64_REORDER)
