"""Whether a config asks for the model a checkpoint was trained with. Weights load into any model
of the same shapes, so a model.* key that changes no shape (model.n_head at a fixed d_model,
model.n_kv_head, model.rope_theta, model.norm_eps, ...) would otherwise go unnoticed: the model
computes something else from the same weights. Every key of the schema's model section is
compared, walked from its dataclasses, so a key added later is compared too; a checkpoint saved
before a key existed records none, and loading its config gives that key its default."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from megatronish.config import Config, derive
from megatronish.config.schema import key_of
from megatronish.errors import UserError

# Model keys a resumed run may change. model.dropout is a training setting that happens to live
# in the model section: no tensor depends on it, eval, generate and export run the model without
# it, and changing it between pretraining and fine-tuning is common practice (Megatron's resume
# checks only the architecture). So is model.mtp_loss_coef, the multi-token prediction loss's
# weight (DeepSeek-V3 lowered it from 0.3 to 0.1 during pretraining). Every other key changes
# what the weights compute.
MAY_DIFFER = frozenset({"model.dropout", "model.mtp_loss_coef"})

Difference = tuple[str, Any, Any]  # (key, the checkpoint's value, the config's value)


def _flat(section: Any, prefix: str) -> dict[str, Any]:
    """Every key of a config section (its sub-sections' too) by its dotted name. A section that
    may be null (model.rope_scaling) is one value: its keys exist only when it is set."""
    out: dict[str, Any] = {}
    types = typing.get_type_hints(type(section))
    for field in dataclasses.fields(section):
        key, value = f"{prefix}.{key_of(field.name)}", getattr(section, field.name)
        is_section = dataclasses.is_dataclass(types[field.name])
        out.update(_flat(value, key) if is_section else {key: value})
    return out


def _resolved(cfg: Config, settings: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """settings with each null that derive resolves replaced by what it stands for: the field of
    Derived named after the key (model.d_ff: d_ff, model.moe.d_ff: moe_d_ff), so d_ff left null
    and d_ff set to its default value compare equal. vocab_size: the run's (a null
    model.vocab_size stands for it)."""
    derived = derive(Config(model=cfg.model), 1, vocab_size=vocab_size)
    return {
        key: getattr(derived, key.removeprefix("model.").replace(".", "_"), None)
        if value is None
        else value
        for key, value in settings.items()
    }


def model_differences(
    saved: Config, saved_vocab: int, wanted: Config, wanted_vocab: int
) -> list[Difference]:
    """The model keys whose values differ between a checkpoint's config (saved, its vocabulary
    saved_vocab) and the config of a run (wanted, with the vocabulary wanted_vocab), in schema
    order; a null compares as the value it stands for."""
    have, want = _flat(saved.model, "model"), _flat(wanted.model, "model")
    differ = [key for key in have if have[key] != want[key]]
    if any(None in (have[key], want[key]) for key in differ):
        have, want = _resolved(saved, have, saved_vocab), _resolved(wanted, want, wanted_vocab)
        differ = [key for key in differ if have[key] != want[key]]
    return [(key, have[key], want[key]) for key in differ]


def _text(value: Any) -> str:
    """A value as YAML and --set write it."""
    if value is None:
        return "null"
    if dataclasses.is_dataclass(value):  # a section that may be null, as one YAML flow line
        flow = dict(default_flow_style=True, sort_keys=False, width=math.inf)
        return yaml.safe_dump(value.to_dict(), **flow).strip()
    return str(value).lower() if isinstance(value, bool) else str(value)


def refuse_other_model(
    differences: list[Difference], step_dir: Path, asker: str, advice: str
) -> list[Difference]:
    """UserError for the first difference not in MAY_DIFFER: `<key>: the checkpoint in
    <step_dir> was trained with <its value>, <asker> <the other>; <advice>`, where advice may
    name {key}, {saved} and {wanted}. Returns the differences in MAY_DIFFER."""
    for key, saved, wanted in differences:
        if key not in MAY_DIFFER:
            values = {"key": key, "saved": _text(saved), "wanted": _text(wanted)}
            raise UserError(
                f"{key}: the checkpoint in {step_dir} was trained with {values['saved']}, "
                f"{asker} {values['wanted']}; " + advice.format(**values)
            )
    return [difference for difference in differences if difference[0] in MAY_DIFFER]
