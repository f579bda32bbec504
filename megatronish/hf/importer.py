"""Hugging Face directory -> our weights: a checkpoint at step 0 (`megatronish import`, weights
only), or a training run's starting weights (checkpoint.init_from_hf)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatronish.checkpoint.load import inference_config, restore_model
from megatronish.checkpoint.reader import FullTensors
from megatronish.checkpoint.save import save_checkpoint
from megatronish.config import Config, Derived, check_values, derive, load_config
from megatronish.errors import UserError
from megatronish.hf.family import HEAD
from megatronish.hf.files import read_config_json, read_tensors
from megatronish.hf.registry import family_of_config_json
from megatronish.hf.tokenizer import read_tokenizer
from megatronish.paths import require_new_output_dir


def read_hf(hf_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], FullTensors]:
    """(our model.* settings, our full unpadded tensors) of a Hugging Face directory; a
    UserError for a family, setting or tensor we cannot run."""
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir}: not a Hugging Face model directory")
    config = read_config_json(hf_dir)
    family = family_of_config_json(config)
    fields = family.model_fields(config)
    hf = {k: v for k, v in read_tensors(hf_dir).items() if not k.endswith(family.buffers)}
    try:
        ours = family.from_hf(hf, fields)
        head = hf.pop(HEAD, None)
        if not fields["tie_embeddings"]:
            if head is None:
                raise KeyError(HEAD)
            ours[HEAD] = head
    except KeyError as exc:
        raise UserError(f"{hf_dir}: tensor {exc} is missing from the weights") from None
    except RuntimeError as exc:
        raise UserError(f"{hf_dir}: tensor shapes do not fit config.json ({exc})") from None
    if hf:
        raise UserError(
            f"{hf_dir}: unexpected tensors {sorted(hf)[:5]}; not a plain {fields['arch']}"
        )
    return fields, FullTensors(ours, hf_dir)


def check_hf_matches(fields: dict[str, Any], cfg: Config, derived: Derived, where: Path) -> None:
    """UserError naming the first model setting of cfg that differs from the HF model's."""
    ours = dict(
        arch=cfg.model.arch,
        n_layer=cfg.model.n_layer,
        n_head=cfg.model.n_head,
        n_kv_head=derived.n_kv_head,
        d_model=cfg.model.d_model,
        d_ff=derived.d_ff,
        vocab_size=derived.vocab_size,
        norm_eps=cfg.model.norm_eps,
        tie_embeddings=derived.tie_embeddings,
        rope_theta=cfg.model.rope_theta,
    )
    theirs = dict(fields, n_kv_head=fields["n_kv_head"] or fields["n_head"])
    theirs["d_ff"] = theirs["d_ff"] or 4 * fields["d_model"]
    if "moe" in fields:  # experts (Mixtral) or none, and their sizes
        moe, hf_moe = cfg.model.moe, fields["moe"]
        ours["moe.num_experts"], theirs["moe.num_experts"] = moe.num_experts, hf_moe.num_experts
        if hf_moe.num_experts:
            del ours["d_ff"]  # no dense MLP
            ours.update({"moe.top_k": moe.top_k, "moe.d_ff": derived.moe_d_ff})
            theirs.update({"moe.top_k": hf_moe.top_k, "moe.d_ff": hf_moe.d_ff})
    for key, value in ours.items():
        if key in theirs and theirs[key] != value:
            raise UserError(
                f"{where / 'config.json'}: the model has {key} {theirs[key]!r}, this config "
                f"{value!r}; set --set model.{key}={theirs[key]}"
            )


def init_from_hf(hf_dir: str, model, cfg: Config, derived: Derived) -> None:
    """Copies a Hugging Face directory's weights into a (tp-sharded) model of the same shape."""
    fields, source = read_hf(hf_dir)
    check_hf_matches(fields, cfg, derived, Path(hf_dir))
    restore_model(source, model)


def import_hf(hf_dir: str, output: str, overrides: tuple[str, ...] = ()) -> tuple[Path, bool]:
    """Writes the weights of a Hugging Face directory as checkpoint `output` (step 0, tp 1;
    model.* from config.json, other keys from the defaults and overrides). Returns (step
    directory, whether a tokenizer was found)."""
    from megatronish.distributed.layout import ParallelState
    from megatronish.model import GPT

    hf_path, out = Path(hf_dir).expanduser(), require_new_output_dir(output, "--output")
    fields, source = read_hf(hf_path)
    cfg = load_config(None, overrides)
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    check_values(cfg)
    cfg = inference_config(cfg, fields["vocab_size"], 1)
    derived = derive(cfg, 1, vocab_size=fields["vocab_size"])
    model = GPT(cfg, derived, ParallelState.single())
    restore_model(source, model)
    tokenizer = read_tokenizer(hf_path, read_config_json(hf_path))
    step_dir = save_checkpoint(
        out, 0, cfg=cfg, derived=derived, ps=model.ps, model=model, tokenizer=tokenizer
    )
    return step_dir, tokenizer is not None
