"""The model families export writes and import reads, and how each side finds its family: import
by config.json's `architectures` (its `model_type` when none of them is known), export by
model.arch and the components the model has. A new family is one module and one entry in
FAMILIES."""

from __future__ import annotations

from typing import Any

from megatronish.config import Config, Derived
from megatronish.errors import UserError
from megatronish.hf import (
    deepseek_v3,
    gemma3,
    gpt2,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from megatronish.hf.family import ConfigJson, Family

FAMILIES: tuple[Family, ...] = (
    gpt2.FAMILY,
    llama.FAMILY,
    mixtral.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5_moe.FAMILY,
    qwen3_next.FAMILY,
    deepseek_v3.FAMILY,
    gemma3.FAMILY,
    gpt_oss.FAMILY,
)


def family_of_config_json(config: ConfigJson) -> Family:
    """The family of a Hugging Face config.json; a UserError naming what it has and the
    families megatronish reads when it is none of them."""
    architectures = config.get("architectures")
    names = architectures if isinstance(architectures, list) else []
    for family in FAMILIES:
        if any(name in family.architectures for name in names):
            return family
    kind = config.get("model_type")
    for family in FAMILIES:
        if kind == family.model_type:
            return family
    has = f"model_type {kind!r}" + (f", architectures {names}" if names else "")
    types = [family.model_type for family in FAMILIES]
    known = ", ".join(types[:-1]) + f" and {types[-1]}"
    read = ", ".join(name for family in FAMILIES for name in family.architectures)
    raise config.refuse(f"{has}; megatronish imports {known} (architectures {read})")


def _components(cfg: Config, derived: Derived) -> dict[str, tuple[bool, str]]:
    """The model's components: name -> (whether it has it, the setting that says so)."""
    model = cfg.model
    moe = model.moe
    sparse = derived.moe_layers
    dense_blocks = bool(sparse) and len(sparse) < model.n_layer + model.mtp_depth
    return {
        "qkv_bias": (model.qkv_bias, f"model.qkv_bias={str(model.qkv_bias).lower()}"),
        "qk_norm": (model.qk_norm, f"model.qk_norm={str(model.qk_norm).lower()}"),
        "experts": (bool(derived.moe_layers), f"model.moe.num_experts={model.moe.num_experts}"),
        "sliding_window": (
            model.sliding_window is not None,
            f"model.sliding_window={model.sliding_window}",
        ),
        "full_attention_layers": (
            model.sliding_window is not None and model.full_attention_layers > 0,
            f"model.full_attention_layers={model.full_attention_layers}",
        ),
        "dense_blocks": (
            dense_blocks,
            f"model.moe.every={moe.every}, first_k_dense={moe.first_k_dense}",
        ),
    }


def _fits(family: Family, component: str, has: Any) -> bool:
    return family.components.get(component, has) == has


def family_of_model(cfg: Config, derived: Derived) -> Family:
    """The family export writes a model of this config as: model.arch's, the one whose class
    has the model's components; a UserError naming the first component none of them has and
    the archs whose class has it."""
    arch = cfg.model.arch
    candidates = [family for family in FAMILIES if family.arch == arch]
    if not candidates:
        raise UserError(f"model.arch {arch!r}: no Hugging Face family exports it")
    for component, (has, setting) in _components(cfg, derived).items():
        fitting = [family for family in candidates if _fits(family, component, has)]
        if not fitting:
            others = sorted({f.arch for f in FAMILIES if _fits(f, component, has)} - {arch})
            classes = " / ".join(family.architecture for family in candidates)
            raise UserError(
                f"{setting}: {classes} (model.arch {arch}, export --format hf) cannot express "
                f"it; model.arch {', '.join(others)} can"
            )
        candidates = fitting
    return candidates[0]
