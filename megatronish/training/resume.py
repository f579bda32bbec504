"""Which checkpoint a run resumes from (checkpoint.resume: auto | never | PATH), and whether the
run's config asks for the model that checkpoint was trained with and data of the tokenizer the
run's starting weights come with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatronish.checkpoint.format import (
    CONFIG_FILE,
    METADATA_FILE,
    find_latest,
    parse_metadata,
    passed_over,
    resolve_step_dir,
)
from megatronish.checkpoint.model_match import model_differences, refuse_other_model
from megatronish.checkpoint.save import tokenizer_identity, tokenizer_of_checkpoint
from megatronish.config import Config, load_config
from megatronish.data.sources import check_trained_tokenizer

if TYPE_CHECKING:
    from megatronish.data.sources import TokenSource


def checkpoint_dir(cfg: Config) -> Path:
    """checkpoint.dir, or <run.out_dir>/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.out_dir) / "checkpoints"


def resume_path(cfg: Config) -> Path | None:
    """The step directory to resume from: never -> None; auto -> the newest complete one in
    checkpoint.dir (None when there is none); a path -> that checkpoint (UserError if missing)."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        return find_latest(checkpoint_dir(cfg))
    return resolve_step_dir(mode)


def auto_choice(cfg: Config, taken: Path | None) -> str | None:
    """Under checkpoint.resume=auto, the line that says why the run takes `taken` (None: starts
    fresh) when checkpoint.dir holds newer step directories, e.g. "checkpoint: resuming from
    step_000020; step_000030 is incomplete (no metadata.json)"; None otherwise."""
    if cfg.checkpoint.resume != "auto":
        return None
    reasons = passed_over(checkpoint_dir(cfg), taken)
    if not reasons:
        return None
    choice = f"resuming from {taken.name}" if taken is not None else "starting fresh"
    return f"checkpoint: {choice}; " + "; ".join(reasons)


def check_resumed_model(cfg: Config, vocab_size: int) -> list[str]:
    """UserError naming the first model.* key whose value in cfg (the run's vocabulary
    vocab_size) differs from the one the resume checkpoint was trained with; returns a line for
    each key that may differ (model_match.MAY_DIFFER) and does. Nothing without a checkpoint
    to resume from."""
    step_dir = resume_path(cfg)
    if step_dir is None:
        return []
    saved = load_config(step_dir / CONFIG_FILE)
    saved_vocab = parse_metadata(step_dir / METADATA_FILE)["vocab_size"]
    differences = model_differences(saved, saved_vocab, cfg, vocab_size)
    new_dir = " or a new checkpoint.dir" if cfg.checkpoint.resume == "auto" else ""
    changed = refuse_other_model(
        differences,
        step_dir,
        "the config asks for",
        f"keep {{key}}={{saved}}, or start over with checkpoint.resume=never{new_dir}",
    )
    return [
        f"checkpoint: {key} is {wanted} in this run; {step_dir} was trained with {saved}"
        for key, saved, wanted in changed
    ]


def check_start_tokenizer(cfg: Config, sources: list[TokenSource]) -> None:
    """UserError naming data.path (or data.blend) and both tokenizers when a dataset's tokenizer
    is not the one the run's starting weights come with: the resume checkpoint's, else the
    checkpoint.init_from_hf directory's. Nothing where either records none (a Megatron prefix,
    a Hugging Face directory without tokenizer files)."""
    step_dir = resume_path(cfg)
    if step_dir is not None:
        tokenizer = tokenizer_of_checkpoint(step_dir, parse_metadata(step_dir / METADATA_FILE))
        model = f"the checkpoint {step_dir} was trained on tokenizer"
    elif cfg.checkpoint.init_from_hf:
        from megatronish.hf.tokenizer import read_tokenizer

        hf_dir = Path(cfg.checkpoint.init_from_hf).expanduser()
        tokenizer, model = read_tokenizer(hf_dir), f"checkpoint.init_from_hf {hf_dir} has tokenizer"
    else:
        return
    if tokenizer is None:
        return
    advice = f"train on data prepared with it (prepare --tokenizer {tokenizer.file or 'byte'})"
    check_trained_tokenizer(cfg, sources, tokenizer_identity(tokenizer), model, advice)
