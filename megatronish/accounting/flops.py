"""Model FLOPs per optimizer step (Narayanan et al. 2021) and the matmul parameters they
count. The device peak that MFU divides by is hardware.GPU_PEAK_TFLOPS (on a GPU) or a measured
matmul rate (training.metrics.peak_flops)."""

from __future__ import annotations

from megatronish.accounting.components import attention_at, gated_deltanet, mlp
from megatronish.accounting.components import moe as moe_cost
from megatronish.accounting.lora import adapter_parameters
from megatronish.config import Config, Derived, attention_window


def matmul_params(cfg: Config, derived: Derived) -> int:
    """Parameters that take part in a matmul per token: every block's linear weights (of an
    MoE MLP, the router and the top_k experts a token goes through) and the output layer, and of
    each multi-token prediction module its eh_proj (2h -> h), its block (dense or MoE as
    config.derive.moe_layers says) and the output layer again (the embedding lookup, norms and
    biases (model.qkv_bias) are not matmuls and not counted)."""
    model, h = cfg.model, cfg.model.d_model
    blocks = model.n_layer + model.mtp_depth  # MoE among both: config.derive.moe_layers
    attn = sum(attention_at(model, i).matmul_params(model, derived) for i in range(blocks))
    dense = mlp.matmul_params(model, derived.d_ff)
    moe = len(derived.moe_layers)
    active = moe * moe_cost.parameters(cfg, derived, active=True) if moe else 0
    mtp = model.mtp_depth * (2 * h * h + h * derived.vocab_size)
    return attn + (blocks - moe) * dense + active + h * derived.vocab_size + mtp


def attention_keys(cfg: Config) -> int:
    """The keys a query's attention scores and values count, summed over the layers: the whole
    sequence, s, in every layer (Narayanan et al. count causal attention unhalved), and under a
    sliding window W the keys it reaches, min(s, W), in the layers that slide; the multi-token
    prediction blocks (indices n_layer ..) count as layers; linear-attention blocks
    (model.layer_types) count none."""
    s, model = cfg.train.seq_len, cfg.model
    layers = range(model.n_layer + model.mtp_depth)
    full = (i for i in layers if model.block_attention(i) != "gated_deltanet")
    windows = (attention_window(model, layer) for layer in full)
    return sum(s if window is None else min(s, window) for window in windows)


def attention_flops_per_token(cfg: Config, derived: Derived) -> int:
    """Forward FLOPs of the attention scores and values per token: 2 a (d + d_v) per key
    counted (q k^T over the query-key head dim d, p v over the value head dim d_v: d but for
    multi-head latent attention), over attention_keys (4 l s h with no window and a d = h);
    plus each linear-attention block's chunked delta rule (accounting.components.gated_deltanet:
    linear in s)."""
    heads, model = cfg.model.n_head, cfg.model
    full = 2 * attention_keys(cfg) * heads * (derived.head_dim + derived.v_head_dim)
    linear = sum(1 for i in range(model.n_layer) if model.block_attention(i) == "gated_deltanet")
    return full + linear * gated_deltanet.rule_flops_per_token(model)


def forward_flops_per_step(cfg: Config, derived: Derived) -> float:
    """Forward FLOPs of one optimizer step: per token 2 x matmul parameters (and the LoRA
    adapters', accounting.lora.adapter_parameters) + attention_flops_per_token."""
    return float(_forward_per_token(cfg, derived) * derived.tokens_per_step)


def _forward_per_token(cfg: Config, derived: Derived) -> int:
    params = matmul_params(cfg, derived) + adapter_parameters(cfg, derived)
    return 2 * params + attention_flops_per_token(cfg, derived)


def model_flops_per_step(cfg: Config, derived: Derived) -> float:
    """Training FLOPs of one optimizer step (Narayanan et al. 2021, written for any MLP):
    3 x forward, forward per token = 2 x matmul parameters + 4 l s h for attention scores and
    values (attention_flops_per_token: s min(s, W) under a sliding window W); x 4/3 with full
    recompute. With d_ff = 4h this is 72 B s l h^2 (1 + s/6h + V/12lh). Under model.lora the
    FLOPs a step does: the adapters' GEMMs counted, and no weight gradient for the frozen
    weights (2 x their parameters per token fewer; the first block's input gradients that do
    not run, accounting.lora.frozen_inputs, stay counted)."""
    passes = 4 if cfg.train.activation_checkpointing == "full" else 3
    frozen = matmul_params(cfg, derived) if cfg.model.lora is not None else 0
    per_token = passes * _forward_per_token(cfg, derived) - 2 * frozen
    return float(per_token * derived.tokens_per_step)
