"""Layout-invariant initialization: each full weight drawn from a generator seeded by its
checkpoint name, this rank keeping its block.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.utils.checkpoint
from torch import nn

from megatronish.layers.lora import init_adapter_a
from megatronish.layers.roles import role
from megatronish.moe.experts import stored_tensors


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, n_layer: int) -> None:
    """GPT-2-style initialization, layout-invariant: each full weight (each expert's, for
    stacked experts) is drawn from a generator seeded by (seed, its checkpoint name) and this
    rank keeps its block. Matrices and embeddings (and multi-token prediction's eh_proj):
    normal(0, 0.02); residual outputs (attention proj, MLP and expert down, linear attention's
    out_proj): normal(0, 0.02 / sqrt(2 n_layer)); biases 0; norm weights and linear attention's
    dt_bias 1 (norm weights 0 where a norm scales by 1 + weight), its A_log log(U(0.01, 16))
    (as transformers' Qwen3.5)."""
    ps = model.ps
    for name, param, index in stored_tensors(model.named_parameters()):
        target = param if index is None else param[index]
        if name.endswith(".bias"):
            target.zero_()
            continue
        tags = role(param)
        if tags.init_fill is not None or "norm" in name or name.endswith("dt_bias"):
            target.fill_(1.0 if tags.init_fill is None else tags.init_fill)
            continue
        gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
        full = torch.zeros(tags.full_shape)
        if name.endswith("A_log"):  # linear attention's decay rates A ~ U(0.01, 16)
            full.uniform_(0.01, 16, generator=gen).log_()
        elif name.endswith("lora_A"):
            init_adapter_a(full, gen)
        else:
            residual = name.endswith(("proj.weight", "down.weight")) and "eh_proj" not in name
            std = 0.02 / math.sqrt(2 * n_layer) if residual else 0.02
            rows = tags.valid_rows if tags.valid_rows is not None else tags.full_shape[0]
            full[:rows].normal_(0.0, std, generator=gen)
        if tags.tp_split_dim is not None:
            full = full.chunk(model.derived.tp, dim=tags.tp_split_dim)[ps.tp_rank]
        target.copy_(full)
