"""Our LoRA adapters' names as peft writes them in adapter_model.safetensors (a Llama-style
model: base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight, ...)."""

from __future__ import annotations

import re

PEFT_BLOCKS = "base_model.model.model.layers."

# Our module path of each target's adapter in a block -> peft's module path of the target.
_MODULES = {
    "attn.qkv.lora.adapters.q_proj": "self_attn.q_proj",
    "attn.qkv.lora.adapters.k_proj": "self_attn.k_proj",
    "attn.qkv.lora.adapters.v_proj": "self_attn.v_proj",
    "attn.proj.lora.adapter": "self_attn.o_proj",
    "mlp.gate.lora.adapters.gate_proj": "mlp.gate_proj",
    "mlp.up.lora.adapters.up_proj": "mlp.up_proj",
    "mlp.down.lora.adapter": "mlp.down_proj",
}
_OURS = re.compile(r"blocks\.(\d+)\.(.+)\.(lora_[AB])$")


def to_peft_name(name: str) -> str:
    """peft's file key of our adapter tensor `name` (blocks.{i}.<module>.lora_A or lora_B)."""
    match = _OURS.fullmatch(name)
    if match is None or match.group(2) not in _MODULES:
        raise KeyError(f"{name}: not an adapter tensor")
    block, module, matrix = match.groups()
    return f"{PEFT_BLOCKS}{block}.{_MODULES[module]}.{matrix}.weight"
