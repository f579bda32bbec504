"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen3.5-MoE's blocks
(megatronish.hf.qwen3_5_moe) in the qwen3_5 preset, with three differences in what it stores.

- Its Gated DeltaNet layers fuse their input projections per key head: in_proj_qkvz gives, for
  each key head, its query rows, its key rows, then its group's value rows and z (output gate)
  rows (g = linear_num_value_heads / linear_num_key_heads value heads each); in_proj_ba gives,
  for each key head, its group's g b (beta) rows then their g a (decay) rows. Import splits them
  into Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (then ours, megatronish.hf.
  qwen3_5); export fuses them back. conv1d's channels are Qwen3.5's.
- Experts sit in the blocks decoder_sparse_step and mlp_only_layers select, dense MLPs of
  intermediate_size elsewhere: the blocks must be those model.moe's first_k_dense and every
  place. Export writes decoder_sparse_step 1 and the dense blocks as mlp_only_layers.
- The router renormalizes its top-k weights under norm_topk_prob (ours, softmax_topk); false is
  refused. Without layer_types, every full_attention_interval-th block is full attention.

Both classes compute the same model where every block has experts: export writes those as
Qwen3_5MoeForCausalLM, and models with dense blocks as this class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatronish.config import Config, Derived
from megatronish.hf import llama, qwen3_5, qwen3_5_moe
from megatronish.hf.family import ConfigJson, Family, Tensors, unfuse_experts
from megatronish.hf.qwen3_moe import EXPERT

EXPERTS = (512, 10)  # Qwen3NextConfig's num_experts and num_experts_per_tok
D_FF = 5632  # its intermediate_size
LINEAR = "model.layers.{}.linear_attn."
QKVZ, BA = "in_proj_qkvz.weight", "in_proj_ba.weight"
SPLIT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


def sparse_blocks(config: ConfigJson, n_layer: int) -> tuple[int, int]:
    """model.moe's (first_k_dense, every) of the blocks with experts: those not in
    mlp_only_layers whose index + 1 is a multiple of decoder_sparse_step; a UserError when no
    such pair places them."""
    step = config.get("decoder_sparse_step", 1)
    dense = config.get("mlp_only_layers") or []
    experts = config.get("num_experts", EXPERTS[0])
    if not isinstance(experts, int) or experts < 1:
        raise config.refuse(
            f"num_experts {experts!r} is not supported; supported: an integer >= 1 (a model "
            "without experts is Qwen3_5ForCausalLM's)"
        )
    valid = isinstance(step, int) and step >= 1 and isinstance(dense, list)
    sparse = [i for i in range(n_layer) if i not in dense and (i + 1) % step == 0] if valid else []
    for every in range(1, n_layer + 1):
        if sparse and sparse == [i for i in range(sparse[0], n_layer) if i % every == 0]:
            return sparse[0], every
    raise config.refuse(
        f"decoder_sparse_step {step} with mlp_only_layers {dense} puts experts in blocks "
        f"{sparse}; supported: blocks first_k_dense, then every multiple of some k after it "
        "(model.moe.first_k_dense and every), e.g. decoder_sparse_step 1 and mlp_only_layers []"
    )


def with_layer_types(config: ConfigJson) -> ConfigJson:
    """config.json with layer_types filled as Qwen3NextConfig fills it from
    full_attention_interval (4 by default) where it has none."""
    if config.get("layer_types") is not None:
        return config
    interval, n_layer = config.get("full_attention_interval", 4), config.need("num_hidden_layers")
    if not isinstance(interval, int) or interval < 1:
        raise config.refuse(
            f"full_attention_interval {interval!r} is not supported; supported: an integer >= 1"
        )
    kinds = [qwen3_5.FULL if (i + 1) % interval == 0 else qwen3_5.LINEAR for i in range(n_layer)]
    return ConfigJson(dict(config.raw, layer_types=kinds), config.path)


def model_fields(config: ConfigJson) -> dict[str, Any]:
    """Our model.* settings: Qwen3.5-MoE's, with the dense blocks of intermediate_size."""
    if not config.get("norm_topk_prob", True):
        raise config.refuse(
            "norm_topk_prob false (the top-k router weights not renormalized) is not supported; "
            "supported: true (model.moe.router softmax_topk)"
        )
    config = with_layer_types(config)
    fields = qwen3_5_moe.model_fields(config, EXPERTS)
    first, every = sparse_blocks(config, fields["n_layer"])
    moe = dataclasses.replace(fields["moe"], first_k_dense=first, every=every)
    return dict(fields, d_ff=config.get("intermediate_size", D_FF), moe=moe)


def config_json(cfg: Config, derived: Derived) -> dict[str, Any]:
    """Qwen3.5-MoE's keys with the dense blocks'; a UserError for a model the class cannot
    express."""
    out = qwen3_5_moe.experts_json(cfg, derived, "Qwen3NextForCausalLM", "qwen3_next", True)
    sparse = derived.moe_layers
    dense = [i for i in range(cfg.model.n_layer) if i not in sparse]
    return dict(out, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=dense)


def _sizes(sizes: Any) -> tuple[int, int, int, int]:
    """(key heads, their dim, value heads per key head, value dim) of the model.linear_* sizes
    (attributes or keys)."""
    get = sizes.get if isinstance(sizes, dict) else lambda key: getattr(sizes, key)
    keys = get("linear_num_key_heads")
    group = get("linear_num_value_heads") // keys
    return keys, get("linear_key_head_dim"), group, get("linear_value_head_dim")


def split_linear(hf: Tensors, prefix: str, sizes: Any) -> None:
    """Replaces `prefix` + in_proj_qkvz and in_proj_ba with Qwen3.5's four projections."""
    keys, d_k, group, d_v = _sizes(sizes)
    qkvz = hf.pop(prefix + QKVZ)
    width = qkvz.shape[1]
    heads = qkvz.reshape(keys, -1, width).split([d_k, d_k, group * d_v, group * d_v], dim=1)
    q, k, v, z = (part.reshape(-1, width) for part in heads)
    b, a = hf.pop(prefix + BA).reshape(keys, 2, group, width).unbind(1)
    parts = (torch.cat([q, k, v]), z, b.reshape(-1, width), a.reshape(-1, width))
    for name, part in zip(SPLIT, parts, strict=True):
        hf[prefix + name] = part.contiguous()


def fuse_linear(hf: Tensors, prefix: str, sizes: Any) -> None:
    """The inverse of split_linear."""
    keys, d_k, group, d_v = _sizes(sizes)
    qkv, z, b, a = (hf.pop(prefix + name) for name in SPLIT)
    width = qkv.shape[1]
    q, k, v = qkv.split([keys * d_k, keys * d_k, keys * group * d_v])
    qkvz = torch.cat([t.reshape(keys, -1, width) for t in (q, k, v, z)], dim=1)
    ba = torch.stack([b.reshape(keys, group, width), a.reshape(keys, group, width)], dim=1)
    hf[prefix + QKVZ] = qkvz.reshape(-1, width).contiguous()
    hf[prefix + BA] = ba.reshape(-1, width).contiguous()


def mlp_names(sparse: tuple[int, ...], num_experts: int) -> llama.MlpNames:
    """Block i's MLP names: Qwen3.5-MoE's in the blocks `sparse`, else a dense MLP's."""
    experts = qwen3_5_moe.mlp_names(num_experts)(0)
    return lambda i: experts if i in sparse else llama.DENSE_MLP


def _linear_blocks(model: Any) -> list[int]:
    return [i for i, kind in enumerate(qwen3_5.layer_types(model)) if kind == qwen3_5.LINEAR]


def to_hf(cfg: Config, derived: Derived, ours: Tensors) -> Tensors:
    names = mlp_names(derived.moe_layers, cfg.model.moe.num_experts)
    hf = qwen3_5.tensors_to_hf(cfg, derived, ours, names)
    for i in _linear_blocks(cfg.model):
        fuse_linear(hf, LINEAR.format(i), cfg.model)
    return hf


def from_hf(hf: Tensors, fields: dict[str, Any]) -> Tensors:
    moe, n_layer = fields["moe"], fields["n_layer"]
    sparse = tuple(i for i in range(moe.first_k_dense, n_layer) if i % moe.every == 0)
    for i in sparse:
        experts = f"model.layers.{i}.mlp.experts."
        unfuse_experts(hf, experts, tuple(theirs for _, theirs in EXPERT), experts)
    for i, kind in enumerate(fields.get("layer_types") or []):
        if kind == qwen3_5.LINEAR:
            split_linear(hf, LINEAR.format(i), fields)
    return qwen3_5.tensors_from_hf(hf, fields, mlp_names(sparse, moe.num_experts))


FAMILY = Family(
    name="Qwen3-Next",
    architectures=("Qwen3NextForCausalLM",),
    model_type="qwen3_next",
    arch="qwen3_5",
    components={**qwen3_5.FAMILY.components, "experts": True},
    model_fields=model_fields,
    config_json=config_json,
    to_hf=to_hf,
    from_hf=from_hf,
    buffers=llama.FAMILY.buffers,
    training_only=llama.TRAINING_ONLY,
)
