"""Model FLOPs per optimizer step (Narayanan et al. 2021) and the matmul parameters they
count. The device peak that MFU divides by is hardware.GPU_PEAK_TFLOPS (on a GPU) or a measured
matmul rate (training.metrics.peak_flops)."""

from __future__ import annotations

from megatronish.accounting.parameters import moe_mlp_params
from megatronish.config import Config, Derived


def matmul_params(cfg: Config, derived: Derived) -> int:
    """Parameters that take part in a matmul per token: every block's linear weights (of an
    MoE MLP, the router and the top_k experts a token goes through) and the output layer (the
    embedding lookup, norms and biases (model.qkv_bias) are not matmuls and not counted)."""
    model, h = cfg.model, cfg.model.d_model
    qkv = h * (model.n_head + 2 * derived.n_kv_head) * derived.head_dim
    proj = model.n_head * derived.head_dim * h
    mlp = (2 if model.gpt2_block else 3) * h * derived.d_ff
    moe = len(derived.moe_layers)
    active = moe * moe_mlp_params(cfg, derived, active=True) if moe else 0
    return (
        model.n_layer * (qkv + proj) + (model.n_layer - moe) * mlp + active + h * derived.vocab_size
    )


def model_flops_per_step(cfg: Config, derived: Derived) -> float:
    """Training FLOPs of one optimizer step (Narayanan et al. 2021, written for any MLP):
    3 x forward, forward per token = 2 x matmul parameters + 4 l s h for attention scores and
    values; x 4/3 with full recompute. With d_ff = 4h this is 72 B s l h^2 (1 + s/6h + V/12lh)."""
    train, model = cfg.train, cfg.model
    attn = 4 * model.n_layer * train.seq_len * model.n_head * derived.head_dim
    forward = 2 * matmul_params(cfg, derived) + attn
    passes = 4 if train.activation_checkpointing == "full" else 3
    return float(passes * forward * derived.tokens_per_step)
