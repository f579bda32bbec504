"""model.arch as a preset: each family's defaults for the component keys, filled in where a
config leaves them unset. A new family is an entry here (and its Hugging Face mapping in
megatronish.hf), never a branch through the model."""

from __future__ import annotations

from typing import Any

_QWEN = {"norm_eps": 1e-6, "rope_theta": 1e6}

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "llama": {},
    "mistral": {},
    "qwen2": {**_QWEN, "qkv_bias": True},
    "qwen3": {**_QWEN, "qk_norm": True},
    "qwen3_moe": {
        **_QWEN,
        "qk_norm": True,
        "moe": {"router": "softmax_topk", "aux_loss_coef": 0.001, "z_loss_coef": 0.0},
    },
}
"""model.* defaults of each model.arch (nested dicts for sub-sections such as model.moe)."""


def with_preset(model: Any, arch: str) -> Any:
    """The model section `model` (a YAML mapping, or anything else, returned as it is for the
    loader to refuse) with the preset of `arch` filling the keys it does not set."""
    if not isinstance(model, dict):
        return model
    return _fill(dict(model), PRESETS.get(arch, {}))


def _fill(section: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    for key, value in defaults.items():
        if not isinstance(value, dict):
            section.setdefault(key, value)
        elif section.get(key) is None:
            section[key] = dict(value)
        elif isinstance(section[key], dict):
            section[key] = _fill(dict(section[key]), value)
    return section
