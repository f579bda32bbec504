"""What a Hugging Face model family is to the shared machinery (`Family`), a config.json as the
families read it (`ConfigJson`), and the name-mapping helpers they share.

Shapes: h d_model, n query heads, k kv heads, d head dim. Ours: qkv [(n + 2k) d, h] laid out by
kv group (each group: its n/k query heads, its key head, its value head); every linear weight
[out, in]. All tensors here are full and unpadded (the real vocab's rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatronish.config import Config, Derived
from megatronish.errors import UserError

Tensors = dict[str, torch.Tensor]
Names = Sequence[tuple[str, str]]  # (our parameter name, theirs), copied as they are
_REQUIRED = object()
HEAD = "lm_head.weight"  # the output layer in every family (an untied model's; tied: absent)


class ConfigJson:
    """A config.json's keys; `need` and `refuse` make UserErrors that name its path."""

    def __init__(self, raw: dict[str, Any], path: Path):
        self.raw, self.path = raw, path

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def need(self, key: str, default: Any = _REQUIRED) -> Any:
        """The key's value (or default); a UserError when it is missing and has none."""
        value = self.raw.get(key, default)
        if value is _REQUIRED:
            raise UserError(f"{self.path}: key '{key}' is missing")
        return value

    def refuse(self, what: str) -> UserError:
        """The error for a setting megatronish cannot run, `what` saying which and why."""
        return UserError(f"{self.path}: {what}")


@dataclass(frozen=True)
class Family:
    """A model family: its config.json translated to our model.* settings and back, and its
    parameter names mapped to ours. The output layer (lm_head.weight, untied models only) and
    the tokenizer are the shared machinery's: `to_hf` and `from_hf` map every other tensor."""

    name: str
    """The family as people name it (in import's and export's help and the manual)."""
    architectures: tuple[str, ...]
    """config.json `architectures` the family reads; export writes the first."""
    model_type: str
    """config.json `model_type`: how a directory is found when no architecture is known."""
    arch: str
    """The model.arch export writes as this family (with `components`)."""
    components: dict[str, bool]
    """What the family's class always has or never has, by component: qkv_bias, qk_norm,
    experts (a mixture-of-experts MLP in some block) and dense_blocks (experts, and a dense MLP
    in some other block); a component it leaves out can be either.
    Export refuses a model whose components differ; import sets them."""
    model_fields: Callable[[ConfigJson], dict[str, Any]]
    """config.json -> our model.* settings (arch first, every component explicit); a UserError
    naming the config.json key for what we cannot run."""
    config_json: Callable[[Config, Derived], dict[str, Any]]
    """Our config -> the family's config.json keys (architectures and model_type first); a
    UserError for a model the family cannot express."""
    to_hf: Callable[[Config, Derived, Tensors], Tensors]
    """Our full tensors -> theirs."""
    from_hf: Callable[[Tensors, dict[str, Any]], Tensors]
    """Their tensors -> ours, given model_fields' settings; pops each tensor it takes (what is
    left is unexpected), KeyError naming one missing."""
    buffers: tuple[str, ...] = ()
    """Endings of tensor names a state dict may hold that are no weights (dropped on import)."""
    embeddings: tuple[str, ...] = ("model.embed_tokens.weight",)
    """The names the input embedding may have: config.json's tie_word_embeddings ties the
    output layer to it."""
    training_only: tuple[tuple[str, float], ...] = ()
    """config.json keys (with the class's default) that transformers applies in training alone,
    dropout and router noise: no weight depends on them, and import notes a non-zero one."""
    unapplied: tuple[str, ...] = ()
    """config.json keys the class reads but its forward does not apply (Gemma3ForCausalLM's
    attn_logit_softcapping): import notes a set one and leaves it out, as transformers runs."""
    export_note: str | None = None
    """A line export prints after writing the family's directory (what it writes otherwise
    than the published checkpoints), or None."""

    @property
    def architecture(self) -> str:
        return self.architectures[0]


def copy_to_hf(ours: Tensors, out: Tensors, names: Names, src: str, dst: str) -> None:
    """out[dst + theirs] = ours[src + our name] for each pair of names."""
    for mine, theirs in names:
        out[dst + theirs] = ours[src + mine]


def take_from_hf(hf: Tensors, ours: Tensors, names: Names, src: str, dst: str) -> None:
    """ours[dst + our name] = the popped hf[src + theirs] for each pair of names."""
    for mine, theirs in names:
        ours[dst + mine] = hf.pop(src + theirs)


def transposed(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def split_qkv(
    fused: torch.Tensor, n_head: int, n_kv_head: int, head_dim: int
) -> tuple[torch.Tensor, ...]:
    """Our grouped qkv rows (per kv head: its group's query heads, then its k and its v; each
    head_dim rows) -> (q [n_head * head_dim, ...], k and v [n_kv_head * head_dim, ...])."""
    rest = fused.shape[1:]
    group = n_head // n_kv_head
    grouped = fused.reshape(n_kv_head, group + 2, head_dim, *rest)
    q = grouped[:, :group].reshape(n_head * head_dim, *rest)
    k = grouped[:, group].reshape(n_kv_head * head_dim, *rest)
    v = grouped[:, group + 1].reshape(n_kv_head * head_dim, *rest)
    return q, k, v


def merge_qkv(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n_head: int,
    n_kv_head: int,
    head_dim: int,
) -> torch.Tensor:
    """The inverse of split_qkv."""
    rest = q.shape[1:]
    parts = [
        q.reshape(n_kv_head, n_head // n_kv_head, head_dim, *rest),
        key.reshape(n_kv_head, 1, head_dim, *rest),
        value.reshape(n_kv_head, 1, head_dim, *rest),
    ]
    rows = (n_head + 2 * n_kv_head) * head_dim
    return torch.cat(parts, dim=1).reshape(rows, *rest).contiguous()


def unfuse_experts(hf: Tensors, fused: str, names: tuple[str, str, str], to: str) -> bool:
    """Renames one block's experts from transformers' in-memory layout (`fused` + gate_up_proj
    [E, 2 f, h], each expert's gate rows then its up rows, and `fused` + down_proj [E, h, f]),
    which from_pretrained also reads, to the per-expert tensors of the Hub's checkpoints:
    `to` + "<e>.<name>.weight" for the gate, up and down names. Whether the block had them."""
    gate_up = hf.pop(fused + "gate_up_proj", None)
    if gate_up is None:
        return False
    gate, up = gate_up.chunk(2, dim=1)
    down = hf.pop(fused + "down_proj")
    for e in range(gate_up.shape[0]):
        for name, weight in zip(names, (gate[e], up[e], down[e]), strict=True):
            hf[f"{to}{e}.{name}.weight"] = weight.contiguous()
    return True
