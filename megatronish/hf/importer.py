"""Hugging Face directory -> our weights: a checkpoint at step 0 (`megatronish import`, weights
only), or a training run's starting weights (checkpoint.init_from_hf)."""

from __future__ import annotations

import copy
import dataclasses
import os
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import yaml

from megatronish.checkpoint.load import inference_config, restore_model
from megatronish.checkpoint.reader import FullTensors
from megatronish.checkpoint.save import save_checkpoint
from megatronish.config import Config, Derived, check_values, derive, load_config
from megatronish.errors import UserError
from megatronish.files import nothing_left_on_failure
from megatronish.hf.family import HEAD, ConfigJson, Family, Tensors
from megatronish.hf.files import CONFIG_JSON, read_config_json, read_tensors
from megatronish.hf.registry import family_of_config_json, family_of_model
from megatronish.hf.tokenizer import read_tokenizer
from megatronish.paths import require_new_output_dir


def read_hf(
    hf_dir: str | os.PathLike[str], notes: list[str] | None = None
) -> tuple[dict[str, Any], FullTensors]:
    """(our model.* settings, our full unpadded tensors) of a Hugging Face directory; a
    UserError for a family, setting or tensor we cannot run. `notes`, when given, gets a "note:"
    line for each thing the import does that config.json alone does not say (an untied head)
    or leaves out (training-time noise)."""
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir}: not a Hugging Face model directory")
    config = read_config_json(hf_dir)
    family = family_of_config_json(config)
    fields = family.model_fields(config)
    hf = {k: v for k, v in read_tensors(hf_dir).items() if not k.endswith(family.buffers)}
    found = [_untied_head(family, config, fields, hf), _training_only(family, config)]
    found += [_unapplied(config, key) for key in family.unapplied]
    if notes is not None:
        notes.extend(note for note in found if note)
    return fields, FullTensors(ours_of_hf(family, fields, hf, str(hf_dir)), hf_dir)


def ours_of_hf(family: Family, fields: dict[str, Any], hf: Tensors, where: str) -> Tensors:
    """Our full tensors of a Hugging Face model's (`hf`, emptied on the way) with its model.*
    settings `fields`; a UserError that names `where` for a missing, misshapen or unexpected
    tensor."""
    try:
        ours = family.from_hf(hf, fields)
        head = hf.pop(HEAD, None)
        if not fields["tie_embeddings"]:
            if head is None:
                raise KeyError(HEAD)
            ours[HEAD] = head
    except KeyError as exc:
        raise UserError(f"{where}: tensor {exc} is missing from the weights") from None
    except RuntimeError as exc:
        raise UserError(f"{where}: tensor shapes do not fit config.json ({exc})") from None
    if hf:
        raise UserError(
            f"{where}: unexpected tensors {sorted(hf)[:5]}; not a plain {fields['arch']}"
        )
    return ours


def load_hf_tensors(model, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Copies a whole model's Hugging Face tensors, (name, tensor) pairs as export writes them,
    into model (a GPT at any layout: each rank keeps its blocks), through its family's mapping;
    a UserError naming `where` for a missing, misshapen or unexpected tensor."""
    cfg, derived = one_process(model.cfg)
    family = family_of_model(cfg, derived)
    fields = family.model_fields(ConfigJson(family.config_json(cfg, derived), Path(where)))
    fields["tie_embeddings"] = derived.tie_embeddings
    hf = {name: t.detach().to("cpu", torch.float32) for name, t in tensors}
    with torch.no_grad():
        restore_model(FullTensors(ours_of_hf(family, fields, hf, where), where), model)


def _untied_head(
    family: Family, config: ConfigJson, fields: dict[str, Any], hf: Tensors
) -> str | None:
    """Unties `fields` where config.json ties the embeddings but the weights hold an lm_head
    that differs from the embedding: transformers then loads both (it ties only equal ones, and
    warns). The note that says so, or None."""
    head = hf.get(HEAD)
    embedding = next((name for name in family.embeddings if name in hf), None)
    if not fields["tie_embeddings"] or head is None or embedding is None:
        return None
    if torch.equal(head, hf[embedding]):
        return None
    fields["tie_embeddings"] = False
    return (
        f"note: {config.path}: tie_word_embeddings is true but {HEAD} differs from {embedding}; "
        "imported untied (model.tie_embeddings false), as transformers loads it"
    )


def _training_only(family: Family, config: ConfigJson) -> str | None:
    """The note naming config.json's non-zero training-time settings (dropout, router noise),
    which no weight depends on and megatronish does not take; None where there are none."""
    found = [
        (key, config.get(key, default))
        for key, default in family.training_only
        if config.get(key, default)
    ]
    if not found:
        return None
    listed = ", ".join(f"{key} {value}" for key, value in found)
    verb = "is" if len(found) == 1 else "are"
    dropout = "; dropout is model.dropout" if any("drop" in key for key, _ in found) else ""
    return (
        f"note: {config.path}: {listed} {verb} training-time noise that megatronish does not "
        f"apply (the weights are the model's{dropout})"
    )


def _unapplied(config: ConfigJson, key: str) -> str | None:
    """The note for a config.json key that the family's class leaves out of its forward."""
    if config.get(key) is None:
        return None
    return (
        f"note: {config.path}: {key} {config.get(key)} is not applied by transformers' model of "
        "this class; imported without it, as transformers runs it"
    )


def _print_notes(notes: list[str]) -> None:
    """Each note, on stderr."""
    for note in notes:
        print(note, file=sys.stderr, flush=True)


NOT_IN_THE_WEIGHTS = (
    "dropout",
    "moe.aux_loss_coef",
    "moe.z_loss_coef",
    "moe.seq_aux_loss_coef",
    "moe.bias_update_speed",
    "moe.capacity_factor",
)
"""Model settings training may choose apart from the Hugging Face model's."""


def with_fields(base: Config, fields: dict[str, Any]) -> Config:
    """A copy of base whose model.* settings are `fields` (a Hugging Face model's)."""
    cfg = copy.deepcopy(base)
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    return cfg


def one_process(cfg: Config) -> tuple[Config, Derived]:
    """cfg's model in one process (inference_config) and its derived sizes."""
    cfg = inference_config(cfg, cfg.model.vocab_size, 1)
    return cfg, derive(cfg, 1)


def model_settings(cfg: Config, derived: Derived) -> dict[str, Any]:
    """Every model.* setting, sizes as derived and model.moe.*'s as moe.<key>, but those no
    weight of this model depends on: the training-only ones, max_seq_len where RoPE takes any
    length, the experts' where there are none, d_ff where every MLP has experts."""
    model = cfg.model
    settings = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    settings.update(
        n_kv_head=derived.n_kv_head,
        head_dim=derived.head_dim,
        d_ff=derived.d_ff,
        vocab_size=derived.vocab_size,
        tie_embeddings=derived.tie_embeddings,
    )
    moe = dataclasses.replace(settings.pop("moe"), d_ff=derived.moe_d_ff)
    settings.update({f"moe.{f.name}": getattr(moe, f.name) for f in dataclasses.fields(moe)})
    mla = settings.pop("mla")
    settings.update({f"mla.{f.name}": getattr(mla, f.name) for f in dataclasses.fields(mla)})
    dropped = set(NOT_IN_THE_WEIGHTS) | ({"max_seq_len"} if model.components.rope else set())
    if not derived.moe_layers:
        dropped |= {key for key in settings if key.startswith("moe.")} - {"moe.num_experts"}
    elif len(derived.moe_layers) == model.n_layer + model.mtp_depth:
        dropped.add("d_ff")
    return {key: value for key, value in settings.items() if key not in dropped}


def _shown(value: Any) -> str:
    """A setting as --set takes it: true/false/null, a section as a YAML flow mapping."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if dataclasses.is_dataclass(value):  # model.rope_scaling
        return yaml.safe_dump(value.to_dict(), default_flow_style=True, sort_keys=False, width=1e9)[
            :-1
        ]
    return str(value)


def check_hf_matches(fields: dict[str, Any], cfg: Config, derived: Derived, where: Path) -> None:
    """One-line UserError naming every setting of the Hugging Face model (`fields`, its
    config.json's model.* settings) that cfg's model does not share, and the --set options
    (quoted for a shell) that give them all. Settings either model's weights do not depend on
    are not compared (a dense d_ff beside experts in every block); those that decide it are
    (moe.num_experts, moe.every)."""
    theirs = model_settings(*one_process(with_fields(cfg, fields)))
    ours = model_settings(cfg, derived)
    differ = [
        key
        for key, value in theirs.items()
        if key.split(".")[0] in fields and key in ours and ours[key] != value
    ]
    if not differ:
        return
    listed = ", ".join(
        f"{key} {_shown(ours[key])} (model has {_shown(theirs[key])})" for key in differ
    )
    sets = " ".join("--set " + shlex.quote(f"model.{key}={_shown(theirs[key])}") for key in differ)
    keys = f"{len(differ)} key" + ("s" if len(differ) > 1 else "")
    raise UserError(
        f"{where / 'config.json'}: this config differs from the Hugging Face model in {keys}: "
        f"{listed}; to match: {sets}"
    )


def init_from_hf(
    hf_dir: str, model, cfg: Config, derived: Derived, main_process: bool = True
) -> None:
    """Copies a Hugging Face directory's weights into a (tp-sharded) model of the same shape;
    the main process prints read_hf's notes."""
    notes: list[str] = []
    fields, source = read_hf(hf_dir, notes)
    check_hf_matches(fields, cfg, derived, Path(hf_dir))
    restore_model(source, model, part="base")
    if main_process:
        _print_notes(notes)


def import_hf(hf_dir: str, output: str, overrides: tuple[str, ...] = ()) -> tuple[Path, bool]:
    """Writes the weights of a Hugging Face directory as checkpoint `output` (step 0, tp 1;
    model.* from config.json, other keys from the defaults and overrides: a model.* override is
    a UserError). Returns (step directory, whether a tokenizer was found: its tokenizer.json and
    companion files, the chat template among them, are copied there). A write the system
    refuses leaves no `output` behind (one that existed before is kept)."""
    from megatronish.distributed.layout import ParallelState
    from megatronish.model import GPT

    hf_path, out = Path(hf_dir).expanduser(), require_new_output_dir(output, "--output")
    _refuse_model_overrides(overrides, hf_path)
    notes: list[str] = []
    fields, source = read_hf(hf_path, notes)
    cfg = with_fields(load_config(None, overrides), fields)
    cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    check_values(cfg)
    cfg, derived = one_process(cfg)
    model = GPT(cfg, derived, ParallelState.single())
    restore_model(source, model)
    tokenizer = read_tokenizer(hf_path)
    with nothing_left_on_failure(out):
        step_dir = save_checkpoint(
            out, 0, cfg=cfg, derived=derived, ps=model.ps, model=model, tokenizer=tokenizer
        )
    _print_notes(notes)
    return step_dir, tokenizer is not None


def _refuse_model_overrides(overrides: tuple[str, ...], hf_dir: Path) -> None:
    """UserError for the first --set of a model.* key: config.json decides the model (with_fields
    would replace the key without a word). The training-only keys, such as model.dropout, are
    set by the run that trains from the checkpoint, in its own config."""
    for assignment in overrides:
        key = assignment.partition("=")[0].strip()
        if key == "model" or key.startswith("model."):
            raise UserError(
                f"--set {assignment}: import takes the model from {hf_dir / CONFIG_JSON} (every "
                "model.* key); drop it (a training run's settings, such as model.dropout, go in "
                "its own config)"
            )
