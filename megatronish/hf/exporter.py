"""Checkpoint -> a Hugging Face directory that transformers' from_pretrained loads with no custom
code, as its family's own class (fp32, the real vocab), written whole or not at all: a write the
system refuses (a full disk) is one line, with nothing left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from megatronish.checkpoint.load import inference_config
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import Config, Derived, derive
from megatronish.files import follow_umask, nothing_left_on_failure, write_failures, write_file
from megatronish.hf.family import HEAD
from megatronish.hf.files import CONFIG_JSON, WEIGHTS, json_bytes
from megatronish.hf.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config,
    lora_adapters,
    merge_adapters,
    merge_expert_adapters,
    peft_tensors,
)
from megatronish.hf.registry import family_of_model
from megatronish.hf.tokenizer import write_tokenizer
from megatronish.paths import require_new_output_dir


def export_hf(checkpoint: str, output: str, merge_lora: bool = False) -> list[str]:
    """Writes checkpoint `checkpoint` as a Hugging Face directory, a LoRA run's with its
    adapters merged (merge_lora, required for one); returns lines to print."""
    out = require_new_output_dir(output, "--output")
    ckpt = Checkpoint(checkpoint)
    cfg = inference_config(ckpt.config, ckpt.vocab_size, 1)
    derived = derive(cfg, 1, vocab_size=ckpt.vocab_size)
    family = family_of_model(cfg, derived)
    config = family.config_json(cfg, derived)  # a model the family cannot express fails here
    info = ckpt.meta.get("tokenizer")
    ckpt.check_in_background()  # every file, while the tensors are read
    adapters = lora_adapters(ckpt, "--merge-lora" if merge_lora else None)
    ours = {name: ckpt.full(name).float() for name in ckpt.specs if name not in adapters}
    ckpt.verify()
    if adapters:
        merge_expert_adapters(ours, adapters, cfg)
    tensors = hf_tensors(cfg, derived, ours)
    if adapters:
        merge_adapters(tensors, adapters, cfg)
    config["tie_word_embeddings"] = derived.tie_embeddings
    eot_id = info["eot_id"] if info else None
    if eot_id is not None:
        config["bos_token_id"] = config["eos_token_id"] = eot_id
    config["torch_dtype"] = "float32"
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    count = sum(t.numel() for t in tensors.values())
    lines = [f"wrote {family.architecture} ({count:,} parameters, vocab {derived.vocab_size})"]
    with nothing_left_on_failure(out, tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_weights(tensors, tmp / WEIGHTS)
        lines.append(write_tokenizer(ckpt, tmp, config, cfg.model.max_seq_len))
        write_file(tmp / CONFIG_JSON, json_bytes(config))
        os.rename(tmp, out)  # replaces an empty `out` (rename(2))
    lines[0] += f" to {out}"
    return lines + ([family.export_note] if family.export_note else [])


def hf_tensors(
    cfg: Config, derived: Derived, ours: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors (names and shapes of the family's class) of our whole, unpadded
    tensors `ours` (a one-process cfg and derived): the family's mapping, and the output layer
    of an untied model."""
    tensors = family_of_model(cfg, derived).to_hf(cfg, derived, ours)
    if not derived.tie_embeddings:
        tensors[HEAD] = ours[HEAD]
    return {name: t.contiguous() for name, t in tensors.items()}


def export_peft(checkpoint: str, output: str) -> list[str]:
    """Writes a LoRA checkpoint's adapters as a PEFT adapter directory, whole or not at all;
    returns lines to print."""
    out = require_new_output_dir(output, "--output")
    ckpt = Checkpoint(checkpoint)
    cfg = inference_config(ckpt.config, ckpt.vocab_size, 1)
    adapters = lora_adapters(ckpt, "--format peft")
    ckpt.verify()
    tensors = {name: t.contiguous() for name, t in peft_tensors(adapters).items()}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with nothing_left_on_failure(out, tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_weights(tensors, tmp / ADAPTER_WEIGHTS)
        write_file(tmp / ADAPTER_CONFIG, json_bytes(adapter_config(cfg)))
        os.rename(tmp, out)
    count = sum(t.numel() for t in tensors.values())
    return [f"wrote a LoRA adapter ({count:,} parameters, rank {cfg.model.lora.rank}) to {out}"]


def write_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """tensors as one safetensors file (save_file writes them from their own memory: no second
    copy of the model), as readable as the user's files. A write the system refuses, which
    safetensors reports as its own error ending "(os error N)", is write_failures' one line
    with the bytes needed."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    with write_failures(path, _safetensors_size(tensors, metadata)):
        try:
            save_file(tensors, str(path), metadata=metadata)
        except SafetensorError as exc:
            code = re.search(r"\(os error (\d+)\)", str(exc))
            if code is None:
                raise
            raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from exc
    follow_umask(path)


def _safetensors_size(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """The bytes of the safetensors file of tensors: 8, the JSON header (each tensor's dtype,
    shape and data offsets, the data laid out by element size, then name) padded to 8, the
    data."""
    from safetensors.torch import _TYPES  # the header's dtype names

    names = {dtype: name for name, dtype in _TYPES.items()}
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0])):
        end = offset + t.numel() * t.element_size()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    length = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + length + (-length) % 8 + offset
