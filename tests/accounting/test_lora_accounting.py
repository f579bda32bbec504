"""A LoRA run's accounting: plan's model state counts the frozen base as weights alone and the
adapters' gradients and AdamW state, and check's data-parallel gradient reduction sends the
adapters' gradients alone; the adapter count is the built model's."""

from __future__ import annotations

from megatronish.accounting.collectives import collectives_per_step
from megatronish.accounting.lora import adapter_counts
from megatronish.accounting.memory import model_state_bytes
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from tests.conftest import CONFIGS

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
