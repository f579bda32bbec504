"""What each component of a block costs, one module per component, named as the model module
whose forward it costs: attention (model.attention, mha), mla (model.mla), gated_deltanet (the
linear attention of model.layer_types), mlp (model.block's MLP: gelu or swiglu), moe
(megatronish.moe.layer), norm (model.norm, and where the block places its norms) and embedding
(the token embedding and the positions: a learned table or rotary). Each states the parameters,
FLOPs, activation bytes and tp collectives of its forward from the component the model builds
(``ModelConfig.components``, megatronish.config.components) and the same sizes; parameters,
flops, memory, layer_time and collectives sum over them, each block's attention its own kind.
"""

from __future__ import annotations

from types import ModuleType

from megatronish.accounting.components import attention, gated_deltanet, mla
from megatronish.config.schema import ModelConfig

ATTENTION: dict[str, ModuleType] = {"mha": attention, "mla": mla, "gated_deltanet": gated_deltanet}
"""The module that costs each attention kind (megatronish.config.components.AttentionKind): each
has parameters, sp_replicated, tp_summed, fp8_exempt, matmul_params, gemm_names, gemms,
activations,
tp_inputs and cache_elements."""


def attention_of(model: ModelConfig) -> ModuleType:
    """The module that costs model's attention (``ATTENTION``)."""
    return ATTENTION[model.components.attention]


def attention_at(model: ModelConfig, index: int) -> ModuleType:
    """The module that costs block `index`'s attention (``ModelConfig.block_attention``: Gated
    DeltaNet where model.layer_types says linear_attention)."""
    return ATTENTION[model.block_attention(index)]
