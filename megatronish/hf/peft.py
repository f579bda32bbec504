"""LoRA adapters as peft reads and writes them (adapter_config.json + adapter_model.safetensors,
a Llama-style model's keys: base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight):
checkpoint.init_lora_from, `export --format peft`, and the merge of `export --merge-lora`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from megatronish.checkpoint.load import restore_model
from megatronish.checkpoint.reader import Checkpoint, FullTensors
from megatronish.config import Config
from megatronish.errors import UserError
from megatronish.hf import peft_experts
from megatronish.layers.lora import is_adapter

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_BLOCKS = "base_model.model.model.layers."

# Our module path of each target's adapter in a block -> the target's module in a block of
# transformers' Llama-style models.
_MODULES = {
    "attn.qkv.lora.adapters.q_proj": "self_attn.q_proj",
    "attn.qkv.lora.adapters.k_proj": "self_attn.k_proj",
    "attn.qkv.lora.adapters.v_proj": "self_attn.v_proj",
    "attn.proj.lora.adapter": "self_attn.o_proj",
    "mlp.gate.lora.adapters.gate_proj": "mlp.gate_proj",
    "mlp.up.lora.adapters.up_proj": "mlp.up_proj",
    "mlp.down.lora.adapter": "mlp.down_proj",
}
_THEIRS = {theirs: ours for ours, theirs in _MODULES.items()}
_OURS = re.compile(r"blocks\.(\d+)\.(.+)\.(lora_[AB])")
_PEFT = re.compile(re.escape(PEFT_BLOCKS) + r"(\d+)\.(.+)\.(lora_[AB])\.weight")


def to_peft_name(name: str) -> str:
    """peft's file key of our adapter tensor `name` (blocks.{i}.<module>.lora_A or lora_B)."""
    match = _OURS.fullmatch(name)
    if match is None or match.group(2) not in _MODULES:
        raise KeyError(f"{name}: not an adapter tensor")
    block, module, matrix = match.groups()
    return f"{PEFT_BLOCKS}{block}.{_MODULES[module]}.{matrix}.weight"


def _from_peft_name(key: str, where: Path) -> str:
    match = _PEFT.fullmatch(key)
    if match is None or match.group(2) not in _THEIRS:
        raise UserError(
            f"{where}: {key!r} is not a LoRA tensor of a Llama-style model's projection"
        )
    block, module, matrix = match.groups()
    return f"blocks.{block}.{_THEIRS[module]}.{matrix}"


def init_lora_from(path: str, model, cfg: Config) -> None:
    """Copies the PEFT adapter in directory `path` into the model's adapters (each rank its
    block), after checking its rank, alpha and targets against model.lora."""
    from safetensors.torch import load_file

    where, lora = Path(path).expanduser(), cfg.model.lora
    key = "checkpoint.init_lora_from"
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (where / name).is_file():
            raise UserError(f"{key}: {where} has no {name}; give a PEFT adapter directory")
    theirs = json.loads((where / ADAPTER_CONFIG).read_text())
    parameters = list(theirs.get("target_parameters") or [])
    targets = sorted(set(theirs.get("target_modules") or []) | set(parameters))
    found = {"r": theirs.get("r"), "lora_alpha": theirs.get("lora_alpha"), "targets": targets}
    wanted = {"r": lora.rank, "lora_alpha": lora.alpha, "targets": sorted(set(lora.targets))}
    for field, value in wanted.items():
        if found[field] != value:
            raise UserError(
                f"{key}: {where / ADAPTER_CONFIG} has {field} {found[field]!r}, model.lora "
                f"{value!r}; set model.lora to the adapter's"
            )
    tensors = load_file(str(where / ADAPTER_WEIGHTS))
    experts = (model.derived.moe_layers, cfg.model.moe.num_experts)
    try:
        ours = peft_experts.from_peft(tensors, parameters, *experts)
    except KeyError as missing:
        raise UserError(f"{key}: {where / ADAPTER_WEIGHTS} has no {missing}") from None
    ours |= {_from_peft_name(k, where): t for k, t in tensors.items()}
    ours = {name: t.float() for name, t in ours.items()}
    restore_model(FullTensors(ours, where / ADAPTER_WEIGHTS), model, part="adapters")


def adapter_config(cfg: Config) -> dict:
    """adapter_config.json of the run's model.lora, as peft writes it."""
    lora = cfg.model.lora
    parameters = [t for t in peft_experts.TARGETS if t in lora.targets]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.checkpoint.init_from_hf,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(set(lora.targets) - set(parameters)),
        "target_parameters": parameters,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def lora_adapters(ckpt: Checkpoint, option: str | None) -> dict[str, torch.Tensor]:
    """The checkpoint's adapter tensors, whole, fp32, for the export option that takes them
    (--merge-lora, --format peft; None: an export of the plain model, given an empty dict); a
    UserError where the export would drop them or the option has none to take."""
    merge_lora = option is not None
    adapters = {name: ckpt.full(name).float() for name in ckpt.specs if is_adapter(name)}
    if adapters and not merge_lora:
        raise UserError(
            f"checkpoint {ckpt.dir}: a LoRA run's (model.lora); export it with --merge-lora "
            "(the merged model) or --format peft (the adapter)"
        )
    if merge_lora and not adapters:
        raise UserError(f"{option}: checkpoint {ckpt.dir} has no LoRA adapters (model.lora)")
    return adapters


def peft_tensors(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's file tensors {key: tensor} of our whole adapter tensors."""
    dense = {n: t for n, t in adapters.items() if not peft_experts.is_expert_adapter(n)}
    tensors = {to_peft_name(name): t for name, t in dense.items()}
    return tensors | peft_experts.to_peft(adapters)


def merge_adapters(
    tensors: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], cfg
) -> None:
    """Adds each dense adapter's scale B A to its projection's weight in `tensors`
    (transformers' names, model.layers.{i}.<module>.weight), in place; the experts' merge
    before the family's mapping (merge_expert_adapters)."""
    lora = cfg.model.lora
    scale = lora.alpha / lora.rank
    for name, a in adapters.items():
        if not name.endswith("lora_A") or peft_experts.is_expert_adapter(name):
            continue
        b = adapters[name[: -len("lora_A")] + "lora_B"]
        weight = to_peft_name(name)[len("base_model.model.") :].replace(".lora_A.weight", ".weight")
        tensors[weight] = tensors[weight] + scale * (b @ a)


def merge_expert_adapters(
    ours: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], cfg
) -> None:
    """Adds each expert adapter's scale B A to its expert's weight in `ours` (our names), in
    place."""
    peft_experts.merge(ours, adapters, cfg.model.lora.alpha / cfg.model.lora.rank)
