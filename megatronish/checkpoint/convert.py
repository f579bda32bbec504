"""`megatronish convert`: rewrites a checkpoint at another tensor-parallel degree, in one
process, on the tensors (no process group): model and optimizer state re-sharded, the vocab
re-padded for the new tp, RNG states mapped as a resume at the new layout would map them."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from megatronish.checkpoint.format import (
    OPTIM_SCALARS,
    TensorSpec,
    model_file,
    optim_file,
    rng_file,
    step_dir_name,
)
from megatronish.checkpoint.load import rng_states_for, single_layout_config
from megatronish.checkpoint.rank_files import write_safetensors
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import base_metadata, finalize, tokenizer_of_checkpoint
from megatronish.config import derive
from megatronish.errors import UserError
from megatronish.files import nothing_left_on_failure
from megatronish.paths import require_new_output_dir


def convert_checkpoint(source: str, tp: int, output: str) -> Path:
    """Writes checkpoint `source` (saved at any tp, dp, pp and ZeRO setting) as a checkpoint
    directory `output` at tp ranks, dp 1 and pp 1, and returns its step directory. Resuming from it
    at tp continues exactly as resuming from the source would."""
    out = require_new_output_dir(output, "--output")
    ckpt = Checkpoint(source)
    if tp < 1:
        raise UserError(f"--tp {tp}: must be a positive integer")
    cfg = single_layout_config(ckpt.config, tp)
    try:
        derived = derive(cfg, tp, vocab_size=ckpt.vocab_size)
    except UserError as exc:
        raise UserError(f"--tp {tp}: {exc}") from None
    specs = {
        name: spec
        if spec.valid_rows is None
        else replace(spec, full_shape=(derived.padded_vocab_size,) + spec.full_shape[1:])
        for name, spec in ckpt.specs.items()
    }
    optimizer_name = (ckpt.meta.get("optimizer") or {}).get("kind")
    has_optimizer = optimizer_name is not None
    tmp = out / f"{step_dir_name(ckpt.step)}.tmp-{os.getpid()}"
    checksums: dict[str, str] = {}
    with nothing_left_on_failure(out, tmp):
        tmp.mkdir(parents=True)
        ckpt.check_in_background()  # every file, while the new shards are written
        for tp_rank in range(tp):
            checksums.update(_write_rank(ckpt, specs, tp, tp_rank, tmp, has_optimizer))
        ckpt.verify()
        tokenizer = tokenizer_of_checkpoint(ckpt.dir, ckpt.meta)
        layout = {"tp": tp, "dp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "world_size": tp}
        meta = base_metadata(
            ckpt.step,
            layout,
            specs,
            ckpt.vocab_size,
            derived.padded_vocab_size,
            cfg.model.arch,
            optimizer_name,
            ckpt.loader_state,
            tokenizer,
        )
        return finalize(out, tmp, meta, cfg, tokenizer, keep=0, checksums=checksums)


def _write_rank(
    ckpt: Checkpoint,
    specs: dict[str, TensorSpec],
    tp: int,
    tp_rank: int,
    tmp: Path,
    has_optimizer: bool,
) -> dict[str, str]:
    """Writes tp rank tp_rank's files of the new checkpoint into `tmp` (its model shard, its
    optimizer state, its RNG states); returns their checksums by file name."""
    checksums = {}
    mine = [name for name, spec in specs.items() if spec.split_dim is not None or tp_rank == 0]
    checksums[model_file(tp_rank)] = write_safetensors(
        tmp / model_file(tp_rank),
        {name: ckpt.block(name, "param", specs[name], tp, tp_rank) for name in mine},
    )
    state = {}
    for name in (n for n in mine if has_optimizer and ckpt.has_optimizer_state(n)):
        for kind in ckpt.optimizer_kinds(name):
            if kind in OPTIM_SCALARS:
                state[f"{name}.{kind}"] = ckpt.scalar(name, kind)
            else:
                state[f"{name}.{kind}"] = ckpt.block(name, kind, specs[name], tp, tp_rank)
    if state:
        checksums[optim_file(tp_rank, 0)] = write_safetensors(tmp / optim_file(tp_rank, 0), state)
    rng = rng_states_for(ckpt, tp, 1, tp_rank)
    if rng is not None:
        checksums[rng_file(tp_rank)] = write_safetensors(tmp / rng_file(tp_rank), rng)
    return checksums
