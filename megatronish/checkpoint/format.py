"""The on-disk layout of a checkpoint: names, metadata.json, atomic writes, finding `latest`.

A tensor is described by a TensorSpec: its full (unsplit) shape, the dim it is split along
over the tp ranks (None: replicated, stored once in tp rank 0's file), its dtype and, for the
vocab-sized tensors, valid_rows, the real vocab size (rows beyond it are zero padding whose
count depends on the tp degree).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatronish.checkpoint.integrity import CHECKSUM_KEY, is_checksum
from megatronish.errors import UserError, read_json_object
from megatronish.layers.roles import role
from megatronish.moe.experts import stored_tensors
from megatronish.optim.registry import OPTIMIZERS

FORMAT = "megatronish-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
CONFIG_FILE = "config.yaml"
LATEST_FILE = "latest"
TOKENIZER_FILE = "tokenizer.json"
STEP_RE = re.compile(r"step_(\d+)")
OPTIM_KINDS = tuple(dict.fromkeys(k for opt in OPTIMIZERS.values() for k in opt.state.kinds))
"""Every kind of optimizer state an optim file may hold: each parameter's are those of the
optimizer that updates it (metadata's optimizer.kind names the run's: AdamW keeps exp_avg,
exp_avg_sq and step; Muon a momentum_buffer for its matrices, AdamW's for the rest)."""
OPTIM_SCALARS = frozenset(k for opt in OPTIMIZERS.values() for k in opt.state.scalars)
"""The kinds that are one fp32 scalar per saved tensor."""
FILE_KINDS = ("model", "optim", "rng")
DTYPES = ("float32", "bfloat16", "float16")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _stage_suffix(pp_rank: int | None) -> str:
    """Files of pipeline stage pp_rank carry _ppNN; None (a run at pp 1) carries nothing."""
    return "" if pp_rank is None else f"_pp{pp_rank:02d}"


def model_file(tp_rank: int, pp_rank: int | None = None, ep_rank: int = 0) -> str:
    """The model shard of tp rank tp_rank (of stage pp_rank); ep ranks after the first, which
    hold other experts, write their experts into _epNN files."""
    ep = f"_ep{ep_rank:02d}" if ep_rank else ""
    return f"model_tp{tp_rank:02d}{ep}{_stage_suffix(pp_rank)}.safetensors"


def optim_file(tp_rank: int, dp_rank: int, pp_rank: int | None = None) -> str:
    return f"optim_tp{tp_rank:02d}_dp{dp_rank:03d}{_stage_suffix(pp_rank)}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.safetensors"


_FILE_RES = {
    "model": re.compile(r"model_tp(\d+)(?:_ep(\d+))?(?:_pp(\d+))?\.safetensors"),
    "optim": re.compile(r"optim_tp(\d+)_dp(\d+)(?:_pp(\d+))?\.safetensors"),
    "rng": re.compile(r"rng_rank(\d+)\.safetensors"),
}


def describe_file(name: str) -> dict[str, Any] | None:
    """{"kind": ..., and tp_rank / dp_rank / rank} for a shard file name; None for others."""
    for kind, pattern in _FILE_RES.items():
        match = pattern.fullmatch(name)
        if match is None:
            continue
        if kind == "model":
            return {
                "kind": kind,
                "tp_rank": int(match[1]),
                "ep_rank": int(match[2] or 0),
                "pp_rank": int(match[3] or 0),
            }
        if kind == "optim":
            return {
                "kind": kind,
                "tp_rank": int(match[1]),
                "dp_rank": int(match[2]),
                "pp_rank": int(match[3] or 0),
            }
        return {"kind": kind, "rank": int(match[1])}
    return None


@dataclass(frozen=True)
class TensorSpec:
    """How one parameter is stored: see the module docstring."""

    full_shape: tuple[int, ...]
    split_dim: int | None
    dtype: str = "float32"
    valid_rows: int | None = None

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape of one tp rank's block."""
        if self.split_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.split_dim] //= tp
        return tuple(shape)

    def real_shape(self) -> tuple[int, ...]:
        """The full shape without vocab padding."""
        if self.valid_rows is None:
            return self.full_shape
        return (self.valid_rows,) + self.full_shape[1:]

    def to_json(self) -> dict[str, Any]:
        return {
            "full_shape": list(self.full_shape),
            "split_dim": self.split_dim,
            "dtype": self.dtype,
            "valid_rows": self.valid_rows,
        }


def dtype_name(dtype) -> str:
    """'float32' for torch.float32 (and so on)."""
    return str(dtype).removeprefix("torch.")


def model_specs(model) -> dict[str, TensorSpec]:
    """The TensorSpec of every stored tensor of a GPT (each expert its own, by global id),
    from their roles (layers.roles)."""
    return {
        name: TensorSpec(
            role(param).full_shape,
            role(param).tp_split_dim,
            dtype_name(param.dtype),
            role(param).valid_rows,
        )
        for name, param, _ in stored_tensors(model.named_parameters())
    }


def saved_tensors(model) -> list[tuple[str, Any, int | None]]:
    """The tensors a stage saves, as (name, parameter, expert index or None) from
    moe.experts.stored_tensors: all but the last stage's copy of tied embeddings."""
    return [
        entry
        for entry in stored_tensors(model.named_parameters())
        if not role(entry[1]).pipeline_duplicate
    ]


def all_stage_specs(model, ps) -> dict[str, TensorSpec]:
    """The TensorSpec of every saved tensor of the whole model, on every rank: each pipeline
    stage's and each ep rank's own (the experts it holds), gathered over the ep and pipeline
    groups."""
    saved = {name for name, _, _ in saved_tensors(model)}
    specs = {name: spec for name, spec in model_specs(model).items() if name in saved}
    import torch.distributed as dist

    for size, group in ((ps.ep, ps.ep_group), (ps.pp, ps.pp_group)):
        if size > 1:
            parts: list = [None] * size
            dist.all_gather_object(parts, specs, group=group)
            specs = {name: spec for part in parts for name, spec in part.items()}
    return specs


# --------------------------------------------------------------------------------------------
# metadata.json


def _bad(path: Path, what: str) -> UserError:
    return UserError(f"{path}: {what}")


def _int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def parse_metadata(path: Path) -> dict[str, Any]:
    """metadata.json of a step directory, checked key by key; UserError naming the file."""
    meta = read_json_object(path, "not a complete checkpoint")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise _bad(
            path,
            f"format {meta.get('format')!r} version {meta.get('format_version')!r}; this "
            f"megatronish reads {FORMAT!r} version {FORMAT_VERSION}",
        )
    layout = meta.get("layout")
    if not _int(meta.get("step")):
        raise _bad(path, f"key 'step' must be a non-negative integer, got {meta.get('step')!r}")
    if not isinstance(layout, dict) or not all(_int(layout.get(k), 1) for k in ("tp", "dp")):
        raise _bad(path, "key 'layout' must hold positive integers 'tp' and 'dp'")
    for key in ("pp", "cp"):
        layout.setdefault(key, 1)
        if not _int(layout[key], 1):
            raise _bad(path, f"key 'layout': '{key}' must be a positive integer")
    for key in ("vocab_size", "padded_vocab_size"):
        if not _int(meta.get(key), 1):
            raise _bad(path, f"key '{key}' must be a positive integer, got {meta.get(key)!r}")
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise _bad(path, "key 'tensors' must map tensor names to their specs")
    meta["tensors"] = {
        name: _parse_spec(path, name, raw, layout["tp"]) for name, raw in tensors.items()
    }
    files = meta.get("files")
    if not isinstance(files, dict):
        raise _bad(path, "key 'files' must map file names to their sizes")
    for name, info in files.items():
        described = describe_file(name)
        if described is None or not isinstance(info, dict) or not _int(info.get("bytes")):
            raise _bad(path, f"files[{name!r}]: not a shard file name with a byte size")
        if CHECKSUM_KEY in info and not is_checksum(info[CHECKSUM_KEY]):
            raise _bad(path, f"files[{name!r}].{CHECKSUM_KEY} must be 8 hex digits")
        info.update(described)
    for key in ("loader", "optimizer", "tokenizer"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise _bad(path, f"key '{key}' must be an object or null")
    tokenizer = meta.get("tokenizer")
    if tokenizer is not None and not _int(tokenizer.get("eot_id")):
        raise _bad(path, "key 'tokenizer.eot_id' must be a non-negative integer")
    return meta


def _parse_spec(path: Path, name: str, raw: Any, tp: int) -> TensorSpec:
    where = f"tensors[{name!r}]"
    if not isinstance(raw, dict):
        raise _bad(path, f"{where} must be an object")
    shape, split, dtype, rows = (
        raw.get(k) for k in ("full_shape", "split_dim", "dtype", "valid_rows")
    )
    if not isinstance(shape, list) or not all(_int(s, 1) for s in shape):
        raise _bad(path, f"{where}.full_shape must be a list of positive integers, got {shape!r}")
    if split is not None and not (_int(split) and split < len(shape)):
        raise _bad(path, f"{where}.split_dim must be null or a dim of full_shape, got {split!r}")
    if split is not None and shape[split] % tp:
        raise _bad(
            path, f"{where}.full_shape[{split}] = {shape[split]} does not split over tp {tp}"
        )
    if dtype not in DTYPES:
        raise _bad(path, f"{where}.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if rows is not None and not (_int(rows, 1) and rows <= shape[0] and split in (0, None)):
        raise _bad(path, f"{where}.valid_rows must be null or in [1, {shape[0]}], got {rows!r}")
    return TensorSpec(tuple(shape), split, dtype, rows)


def metadata_json(meta: dict[str, Any]) -> str:
    """metadata.json's text (TensorSpecs written as objects)."""
    out = dict(meta, tensors={name: spec.to_json() for name, spec in meta["tensors"].items()})
    return json.dumps(out, indent=1) + "\n"


# --------------------------------------------------------------------------------------------
# Atomic writes


# --------------------------------------------------------------------------------------------
# Finding checkpoints


def complete_steps(directory: Path) -> list[Path]:
    """The step directories of a checkpoint.dir that finished saving, oldest first (a save in
    progress, *.tmp-*, has another name and is never listed)."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = STEP_RE.fullmatch(child.name)
        if match and (child / METADATA_FILE).is_file():
            found.append((int(match[1]), child))
    return [path for _, path in sorted(found)]


def find_latest(directory: Path) -> Path | None:
    """The step directory `latest` names; if that is missing or broken, the newest complete step
    directory; None when there is none."""
    pointer = directory / LATEST_FILE
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if STEP_RE.fullmatch(name) and (directory / name / METADATA_FILE).is_file():
            return directory / name
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def passed_over(directory: Path, taken: Path | None) -> list[str]:
    """Why find_latest(directory) took `taken` (None: no checkpoint) over each newer step
    directory: "step_000030 is incomplete (no metadata.json)", or, for a complete one that
    `latest` does not name, "step_000040 is newer, but 'latest' names step_000030"."""
    if not directory.is_dir():
        return []
    after = int(STEP_RE.fullmatch(taken.name)[1]) if taken is not None else -1
    newer = sorted(
        (int(match[1]), child)
        for child in directory.iterdir()
        if (match := STEP_RE.fullmatch(child.name)) and child.is_dir() and int(match[1]) > after
    )
    return [
        f"{child.name} is incomplete (no {METADATA_FILE})"
        if taken is None or not (child / METADATA_FILE).is_file()
        else f"{child.name} is newer, but '{LATEST_FILE}' names {taken.name}"
        for _, child in newer
    ]


def resolve_step_dir(path: str | os.PathLike[str]) -> Path:
    """A step directory itself, or the newest complete one of a checkpoint.dir."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"{path}: checkpoint does not exist")
    if not path.is_dir():
        raise UserError(
            f"{path}: not a directory; a checkpoint is a step directory or a checkpoint.dir "
            f"with a '{LATEST_FILE}' file"
        )
    if (path / METADATA_FILE).exists():
        return path
    if ".tmp-" in path.name:
        raise UserError(f"{path}: an interrupted or unfinished save; use a complete step directory")
    latest = find_latest(path)
    if latest is None:
        raise UserError(
            f"{path}: no checkpoint here (no {METADATA_FILE}, no '{LATEST_FILE}', no complete "
            "step_* directory)"
        )
    return latest
