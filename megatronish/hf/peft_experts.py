"""The experts' LoRA adapters (moe.adapters) as peft holds them for transformers' fused experts
(LoraConfig.target_parameters experts.gate_up_proj and experts.down_proj: lora.ParamWrapper).

peft's layout, per block and target, E experts, r rank: lora_A [E r, in] grouped by expert
(expert e's A rows e r .. e r + r - 1), lora_B [out, r E] with the expert index fastest (expert
e's B column k at k E + e); gate_up_proj's out is gate's rows then up's. Several targets of one
module nest: the first of target_parameters is innermost, its keys under
`experts.base_layer.` once per target after it (export writes gate_up_proj first).
"""

from __future__ import annotations

import re

import torch

from megatronish.moe.adapters import DOWN, GATE_UP

PEFT_BLOCKS = "base_model.model.model.layers."
TARGETS = (GATE_UP, DOWN)  # in the order export writes target_parameters
# Our adapter tensors of one expert (blocks.{i}.mlp.experts.{e}.<adapter>.lora_X) per target.
_OURS = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up|gate|up|down)\.(lora_[AB])")
# Each target's A and its B's parts (in the rows' order of peft's B).
_ADAPTERS = {
    GATE_UP: ("gate_up.lora_A", "gate.lora_B", "up.lora_B"),
    DOWN: ("down.lora_A", "down.lora_B"),
}
# Our expert weight each B adapts, and the A it shares.
_MERGED = {"gate.lora_B": ("gate", "gate_up"), "up.lora_B": ("up", "gate_up")}
_MERGED["down.lora_B"] = ("down", "down")


def is_expert_adapter(name: str) -> bool:
    """Whether our adapter tensor `name` is an expert's."""
    return _OURS.fullmatch(name) is not None


def peft_key(block: int, target: str, matrix: str, targets: list[str]) -> str:
    """peft's file key of target's lora_A or lora_B in a block, targets: target_parameters."""
    mine = [t for t in targets if t in TARGETS]
    nest = "base_layer." * (len(mine) - 1 - mine.index(target))
    return f"{PEFT_BLOCKS}{block}.mlp.experts.{nest}{matrix}.weight"


def expert_targets(adapters: dict[str, torch.Tensor]) -> list[str]:
    """The expert targets of our adapter tensors, in the order export writes them."""
    names = {m.group(3) for m in map(_OURS.fullmatch, adapters) if m}
    return [t for t, mine in ((GATE_UP, "gate_up"), (DOWN, "down")) if mine in names]


def _per_block(adapters: dict[str, torch.Tensor]) -> dict[int, dict[str, list[torch.Tensor]]]:
    """{block: {adapter.matrix: [expert 0's, expert 1's, ...]}} of our expert adapter tensors."""
    blocks: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in adapters.items():
        match = _OURS.fullmatch(name)
        if match:
            block, expert, adapter, matrix = match.groups()
            tensors = blocks.setdefault(int(block), {}).setdefault(f"{adapter}.{matrix}", {})
            tensors[int(expert)] = tensor
    return {b: {k: [v[e] for e in sorted(v)] for k, v in m.items()} for b, m in blocks.items()}


def to_peft(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's tensors {file key: tensor} of our expert adapter tensors (whole, per expert)."""
    targets, out = expert_targets(adapters), {}
    for block, parts in _per_block(adapters).items():
        for target in targets:
            a_name, *b_names = _ADAPTERS[target]
            b = [torch.cat(rows) for rows in zip(*(parts[n] for n in b_names))]  # [out, r] each
            out[peft_key(block, target, "lora_A", targets)] = torch.cat(parts[a_name])
            out[peft_key(block, target, "lora_B", targets)] = torch.stack(b, -1).flatten(1)
    return out


def from_peft(
    tensors: dict[str, torch.Tensor], targets: list[str], blocks: list[int], experts: int
) -> dict[str, torch.Tensor]:
    """Our expert adapter tensors {name: tensor} from peft's (target_parameters `targets`) of
    the `blocks` with `experts` experts each; the keys taken are removed from `tensors` (a
    KeyError names one that is missing)."""
    out = {}
    for block in blocks:
        for target in [t for t in targets if t in TARGETS]:
            a = tensors.pop(peft_key(block, target, "lora_A", targets))
            b = tensors.pop(peft_key(block, target, "lora_B", targets))
            a_name, *b_names = _ADAPTERS[target]
            rows = b.shape[0] // len(b_names)
            b_experts = b.unflatten(1, (-1, experts)).permute(2, 0, 1)  # [E, out, r]
            for e in range(experts):
                prefix = f"blocks.{block}.mlp.experts.{e}."
                out[prefix + a_name] = a.chunk(experts)[e]
                for j, b_name in enumerate(b_names):
                    out[prefix + b_name] = b_experts[e, j * rows : (j + 1) * rows]
    return out


def merge(ours: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> None:
    """Adds each expert adapter's scale B A to its expert's weight in `ours` (our names,
    blocks.{i}.mlp.experts.{e}.gate.weight ...), in place."""
    for name, b in adapters.items():
        match = _OURS.fullmatch(name)
        if match is None or name.endswith("lora_A"):
            continue
        expert = name[: -len(f"{match.group(3)}.lora_B")]
        weight, shared = _MERGED[f"{match.group(3)}.lora_B"]
        a = adapters[f"{expert}{shared}.lora_A"]
        ours[f"{expert}{weight}.weight"] = ours[f"{expert}{weight}.weight"] + scale * (b @ a)
