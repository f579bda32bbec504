"""Reading a Hugging Face directory: its config.json and its safetensors weights (one
model.safetensors, or the shards a model.safetensors.index.json names). Nothing is unpickled.
And the bytes of the JSON files export writes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatronish.errors import UserError, read_json_object
from megatronish.hf.family import ConfigJson

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def json_bytes(data: dict) -> bytes:
    """A JSON file's bytes as transformers writes them: indented by 2, a final newline."""
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")


def read_json(path: Path) -> dict:
    return read_json_object(path, "a Hugging Face model directory has a config.json")


def read_config_json(hf_dir: Path) -> ConfigJson:
    path = hf_dir / CONFIG_JSON
    return ConfigJson(read_json(path), path)


def read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's weights, as fp32; a UserError when there are none or a
    file is not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single, index = hf_dir / WEIGHTS, hf_dir / WEIGHTS_INDEX
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: key 'weight_map' must map tensor names to files")
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
    else:
        raise UserError(f"{hf_dir}: no {WEIGHTS} (only safetensors weights are read)")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update({k: v.float() for k, v in load_file(str(path)).items()})
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path}: not a readable safetensors file ({exc})") from None
    return tensors
