"""The model families export writes and import reads, and how each side finds its family: import
by config.json's `architectures` (its `model_type` when none is known), export by our config.
A new family is one module and one entry in FAMILIES."""

from __future__ import annotations

from megatronish.config import Config, Derived
from megatronish.errors import UserError
from megatronish.hf import gpt2, llama, mixtral
from megatronish.hf.family import ConfigJson, Family

FAMILIES: tuple[Family, ...] = (gpt2.FAMILY, llama.FAMILY, mixtral.FAMILY)


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


def family_of_model(cfg: Config, derived: Derived) -> Family:
    """The family export writes a model of this config as."""
    for key, off in (("qkv_bias", "false"), ("qk_norm", "false"), ("sliding_window", "null")):
        if getattr(cfg.model, key) not in (False, None):
            raise UserError(
                f"model.{key}: no Hugging Face family here exports it (only models with "
                f"model.{key}={off} export)"
            )
    for family in FAMILIES:
        if family.exports(cfg, derived):
            return family
    raise UserError(f"model.arch {cfg.model.arch!r}: no Hugging Face family exports it")
