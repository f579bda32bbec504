"""Reading tensors out of a checkpoint, re-sharded for any tp degree.

Two sources share one interface (check_compatible, block, has_optimizer_state, scalar):
Checkpoint, a saved step directory whose shards are read lazily, slice by slice, from
memory-mapped safetensors files; and FullTensors, whole unpadded tensors in memory (weights
from a Hugging Face directory).

Re-sharding a split tensor: the full tensor is the concatenation of the saved shards along the
split dim; the rows of a vocab tensor beyond valid_rows are padding and read as zeros, so the
new tp degree's padded vocab (a different row count) is filled correctly; the new rank keeps
its contiguous block. Only the saved slices that overlap that block are read.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megatronish.checkpoint.format import (
    CONFIG_FILE,
    METADATA_FILE,
    OPTIM_KINDS,
    OPTIM_SCALARS,
    TOKENIZER_FILE,
    TensorSpec,
    model_file,
    parse_metadata,
    resolve_step_dir,
)
from megatronish.checkpoint.integrity import (
    CHECKSUM_KEY,
    CorruptCheckpoint,
    announce_unverifiable,
    checksum_of,
    map_file,
    mismatch,
    parse_safetensors,
)
from megatronish.config import Config, load_config
from megatronish.errors import UserError

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_specs(saved: dict[str, TensorSpec], wanted: dict[str, TensorSpec], where: str) -> None:
    """UserError naming `where` unless every tensor the model wants is saved with the same split
    and the same shape (the vocab rows compared without padding)."""
    missing = [n for n in wanted if n not in saved]
    extra = [n for n in saved if n not in wanted]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
        if extra:
            parts.append(f"has extra {', '.join(extra[:3])}" + (" ..." if len(extra) > 3 else ""))
        raise UserError(
            f"{where}: the saved model does not match this config's model ({'; '.join(parts)}); "
            "check model.arch, model.n_layer and model.tie_embeddings"
        )
    for name, want in wanted.items():
        have = saved[name]
        if have.real_shape() != want.real_shape() or have.split_dim != want.split_dim:
            raise UserError(
                f"{where}: tensor '{name}' is {_shape_text(have.real_shape())} (split dim "
                f"{have.split_dim}) in the checkpoint but {_shape_text(want.real_shape())} (split "
                f"dim {want.split_dim}) in this config's model; check the model.* settings"
            )


class Checkpoint:
    """A complete step directory, checked when opened: metadata.json parses, every file it
    lists exists with its recorded size and a readable safetensors header, and every tensor has
    a shard of the recorded shape for each saved tp rank. Any problem is a UserError naming the
    file and what is wrong (a CorruptCheckpoint when a file is not what metadata.json recorded).

    A file's tensors are views of its memory-mapped bytes, whose checksum a second thread
    computes from the first use on; verify() waits for those verdicts and checks the files not
    read, so every loader calls it before it returns. A checkpoint saved without checksums
    loads with a one-line note (on the main process only: not on torchrun ranks other than 0)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.dir = resolve_step_dir(path)
        self.meta_path = self.dir / METADATA_FILE
        self.meta = parse_metadata(self.meta_path)
        self.step: int = self.meta["step"]
        self.tp: int = self.meta["layout"]["tp"]
        self.dp: int = self.meta["layout"]["dp"]
        self.pp: int = self.meta["layout"]["pp"]
        self.cp: int = self.meta["layout"]["cp"]
        self.vocab_size: int = self.meta["vocab_size"]
        self.specs: dict[str, TensorSpec] = self.meta["tensors"]
        self._handles: dict[str, object] = {}
        self._mapped: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._verified: set[str] = set()
        self._pending: dict[str, Future] = {}
        self._checker: ThreadPoolExecutor | None = None
        self._index: dict[tuple[str, str], dict[int, str]] = {}
        self._check_files()
        self.checksums: dict[str, str | None] = {
            name: info.get(CHECKSUM_KEY) for name, info in self.meta["files"].items()
        }
        if not all(self.checksums.values()):
            announce_unverifiable(self.dir, os.environ.get("RANK", "0") == "0")
        self._build_index()

    # ---- checks on open

    def _check_files(self) -> None:
        for name, info in self.meta["files"].items():
            path = self.dir / name
            if not path.is_file():
                raise CorruptCheckpoint(path, f"missing (listed in {self.meta_path})")
            size = path.stat().st_size
            if size != info["bytes"]:
                raise CorruptCheckpoint(
                    path,
                    f"{size} bytes, but {METADATA_FILE} records {info['bytes']}; the file is "
                    "truncated or corrupt",
                )

    def _open(self, name: str):
        handle = self._handles.get(name)
        if handle is None:
            path = self.dir / name
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                self.verify([name])  # a corrupt header: name the checksum when it differs
                raise CorruptCheckpoint(path, f"not a readable safetensors file ({exc})") from None
            self._handles[name] = handle
        return handle

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors of file `name`: views of its memory-mapped bytes (copy-on-write), whose
        checksum is computed in the checker thread from now on (verify() waits for it)."""
        tensors = self._tensors.get(name)
        if tensors is None:
            path, (mapped, data) = self.dir / name, self._map(name)
            if self._unchecked(name):
                self._submit(name, checksum_of, mapped)
            try:
                tensors = parse_safetensors(data, path)
            except CorruptCheckpoint:
                self.verify([name])  # a corrupt header: name the checksum when it differs
                raise
            self._tensors[name] = tensors
        return tensors

    def _map(self, name: str) -> tuple[mmap.mmap, torch.Tensor]:
        """File `name` memory-mapped once (see map_file): the checker thread and the tensors
        read the same pages, so each comes from the disk once."""
        mapping = self._mapped.get(name)
        if mapping is None:
            mapping = self._mapped[name] = map_file(self.dir / name)
        return mapping

    def _unchecked(self, name: str) -> bool:
        known = name in self._pending or name in self._verified
        return bool(self.checksums.get(name)) and not known

    def _submit(self, name: str, function, argument) -> None:
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="checksum")
        self._pending[name] = self._checker.submit(function, argument)

    def share(self, rank: int, world_size: int) -> list[str]:
        """This rank's share of the files (every world_size-th, from `rank`): the ranks of a run
        check every file between them, each once."""
        return sorted(self.meta["files"])[rank::world_size]

    def check_in_background(self, names=None) -> None:
        """Starts checking files `names` (default: every file) against their checksums in the
        checker thread, while the caller goes on (building a model, copying tensors)."""
        for name in sorted(self.meta["files"] if names is None else names):
            if self._unchecked(name):
                self._submit(name, checksum_of, self._map(name)[0])

    def verify(self, names=None) -> None:
        """Checks files `names` (default: every file) and every file read so far against their
        checksums, waiting for the checks under way; CorruptCheckpoint naming the first file
        that differs from its record. Files saved without a checksum are skipped."""
        self.check_in_background(names)
        for name in sorted(self._pending):
            actual = self._pending.pop(name).result()
            self._verified.add(name)
            if name not in self._tensors:
                self._mapped.pop(name)  # mapped only to be checked: unmapped when unused
            if actual != self.checksums[name]:
                raise mismatch(self.dir / name, actual, self.checksums[name])
        if self._checker is not None:
            self._checker.shutdown()
            self._checker = None

    def _build_index(self) -> None:
        for fname, info in sorted(self.meta["files"].items()):
            if info["kind"] == "rng":
                continue
            path, handle, tp_rank = self.dir / fname, self._open(fname), info["tp_rank"]
            if tp_rank >= self.tp:
                raise UserError(f"{path}: tp rank {tp_rank} in a checkpoint saved at tp {self.tp}")
            for key in handle.keys():
                if info["kind"] == "model":
                    name, kind = key, "param"
                else:
                    name, _, kind = key.rpartition(".")
                    if kind not in OPTIM_KINDS:
                        raise UserError(f"{path}: unexpected tensor '{key}'")
                spec = self.specs.get(name)
                if spec is None:
                    raise UserError(f"{path}: tensor '{key}' is not in {METADATA_FILE}")
                view = handle.get_slice(key)
                shape = tuple(view.get_shape())
                expected = () if kind in OPTIM_SCALARS else spec.local_shape(self.tp)
                if shape != expected:
                    raise UserError(
                        f"{path}: tensor '{key}' is {_shape_text(shape)}, but {METADATA_FILE} "
                        f"says {_shape_text(expected)} (full {_shape_text(spec.full_shape)} at tp "
                        f"{self.tp}); the file belongs to another checkpoint or is corrupt"
                    )
                if kind == "param" and _SAFETENSORS_DTYPES.get(view.get_dtype()) != spec.dtype:
                    raise UserError(
                        f"{path}: tensor '{key}' is {view.get_dtype()}, {METADATA_FILE} says "
                        f"{spec.dtype}"
                    )
                owners = self._index.setdefault((kind, name), {})
                if tp_rank in owners:
                    raise UserError(f"{path}: tensor '{key}' is also in {owners[tp_rank]}")
                owners[tp_rank] = fname
        for name, spec in self.specs.items():
            needed = range(self.tp) if spec.split_dim is not None else range(1)
            have = self._index.get(("param", name), {})
            for tp_rank in needed:
                if tp_rank not in have:
                    path = self.dir / model_file(tp_rank)
                    raise UserError(f"{path}: missing, or lacks its shard of tensor '{name}'")
            kinds = self.optimizer_kinds(name)
            if self.meta.get("optimizer") is None or not kinds:
                continue  # no optimizer state, or none for this parameter (it starts fresh)
            for kind in kinds:
                have = self._index[(kind, name)]
                if any(r not in have for r in needed):
                    raise UserError(
                        f"{self.dir}: the optimizer state '{kind}' of '{name}' lacks tp ranks "
                        f"{[r for r in needed if r not in have]} (a missing optim_*.safetensors?)"
                    )

    # ---- what else the checkpoint holds

    @cached_property
    def config(self) -> Config:
        """The resolved config the checkpoint was saved with."""
        return load_config(self.dir / CONFIG_FILE)

    @property
    def loader_state(self) -> dict | None:
        return self.meta.get("loader")

    def tokenizer(self):
        """The tokenizer of the data the model was trained on; UserError if none was saved."""
        from megatronish.data import ByteTokenizer, load_tokenizer_file

        info = self.meta.get("tokenizer")
        if info is None:
            raise UserError(f"{self.meta_path}: the checkpoint records no tokenizer")
        if info.get("kind") == "byte":
            return ByteTokenizer()
        return load_tokenizer_file(self.dir / TOKENIZER_FILE, name=str(info.get("kind")))

    def rng_states(self, rank: int) -> dict[str, torch.Tensor] | None:
        """Global rank `rank`'s saved RNG states, or None when it was not saved."""
        for fname, info in self.meta["files"].items():
            if info["kind"] == "rng" and info["rank"] == rank:
                return {key: value.clone() for key, value in self.tensors(fname).items()}
        return None

    # ---- the source interface

    def check_compatible(self, wanted: dict[str, TensorSpec]) -> None:
        check_specs(self.specs, wanted, str(self.meta_path))

    def has_optimizer_state(self, name: str) -> bool:
        return self.meta.get("optimizer") is not None and bool(self.optimizer_kinds(name))

    def optimizer_kinds(self, name: str) -> tuple[str, ...]:
        """The kinds of optimizer state saved for tensor `name` (OPTIM_KINDS' order)."""
        return tuple(kind for kind in OPTIM_KINDS if (kind, name) in self._index)

    def scalar(self, name: str, kind: str = "step") -> torch.Tensor:
        owners = self._index[(kind, name)]
        return self.tensors(owners[min(owners)])[f"{name}.{kind}"]

    def _slice(self, kind: str, name: str, tp_rank: int) -> torch.Tensor:
        fname = self._index[(kind, name)][tp_rank]
        return self.tensors(fname)[name if kind == "param" else f"{name}.{kind}"]

    def read_range(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along the split dim of the full tensor (kind: param, exp_avg or
        exp_avg_sq); vocab rows at or beyond valid_rows are zeros, also past the saved padding."""
        spec = self.specs[name]
        dim = spec.split_dim
        assert dim is not None
        limit = spec.valid_rows if spec.valid_rows is not None else spec.full_shape[dim]
        local = spec.full_shape[dim] // self.tp
        pieces, pos, real_stop = [], start, min(stop, limit)
        while pos < real_stop:
            shard = pos // local
            upto = min(real_stop, (shard + 1) * local)
            index = [slice(None)] * len(spec.full_shape)
            index[dim] = slice(pos - shard * local, upto - shard * local)
            pieces.append(self._slice(kind, name, shard)[tuple(index)])
            pos = upto
        if stop > max(start, real_stop):
            shape = list(spec.full_shape)
            shape[dim] = stop - max(start, real_stop)
            dtype = pieces[0].dtype if pieces else getattr(torch, spec.dtype)
            pieces.append(torch.zeros(shape, dtype=dtype))
        # Contiguous: a slice of one saved shard (a row-parallel block) is a strided view, and
        # fused AdamW silently mis-updates non-contiguous state.
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)).contiguous()

    def block(
        self, name: str, kind: str, target: TensorSpec, tp: int, tp_rank: int
    ) -> torch.Tensor:
        """tp rank tp_rank's block (of tp) of tensor `name` for a model whose spec is `target`."""
        spec = self.specs[name]
        if spec.split_dim is None:
            owners = self._index[(kind, name)]
            key = name if kind == "param" else f"{name}.{kind}"
            return self.tensors(owners[min(owners)])[key]
        local = target.full_shape[spec.split_dim] // tp
        return self.read_range(name, kind, tp_rank * local, (tp_rank + 1) * local)

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        """The whole tensor without vocab padding."""
        spec = self.specs[name]
        if spec.split_dim is None:
            return self.block(name, kind, spec, 1, 0)
        return self.read_range(name, kind, 0, spec.real_shape()[spec.split_dim])


class FullTensors:
    """Whole, unpadded tensors in memory under the model's parameter names (e.g. mapped from a
    Hugging Face directory, named by `where` in errors); no optimizer state."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str | Path):
        self.tensors, self.where = tensors, str(where)

    def check_compatible(self, wanted: dict[str, TensorSpec]) -> None:
        saved = {
            name: TensorSpec(tuple(t.shape), wanted[name].split_dim if name in wanted else None)
            for name, t in self.tensors.items()
        }
        check_specs(saved, wanted, self.where)

    def has_optimizer_state(self, name: str) -> bool:
        return False

    def block(
        self, name: str, kind: str, target: TensorSpec, tp: int, tp_rank: int
    ) -> torch.Tensor:
        tensor = self.tensors[name]
        if target.valid_rows is not None and target.full_shape[0] > tensor.shape[0]:
            pad = tensor.new_zeros((target.full_shape[0] - tensor.shape[0],) + tensor.shape[1:])
            tensor = torch.cat([tensor, pad])
        if target.split_dim is None:
            return tensor
        return tensor.chunk(tp, dim=target.split_dim)[tp_rank]
