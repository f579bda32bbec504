"""Bytes one rank holds of the model's state between steps and what a step adds to it: the
weights (with their bf16 copies and fp8 casts), gradients and optimizer state at each ZeRO level
(see accounting.memory's module doc for the formulas), the routing biases, and what ZeRO's
reductions and gathers hold; LoRA's frozen base and Muon's whole matrices counted as held."""

from __future__ import annotations

from megatronish.accounting.components import attention_at, norm
from megatronish.accounting.components.moe import local_parameters, router_params
from megatronish.accounting.lora import (
    adapter_counts,
    bf16_held_saving,
    expert_adapter_counts,
    frozen_input_casts,
)
from megatronish.accounting.muon import local_elements, stage_matrices, whole_under_zero
from megatronish.accounting.parameters import (
    local_layer_params,
    local_parameter_count,
    mtp_params,
    stage_blocks,
    stage_moe_layers,
    tp_summed_grad_count,
)
from megatronish.config import Config, Derived
from megatronish.optim import IN_FLIGHT


def model_state_bytes(cfg: Config, derived: Derived, pp_rank: int) -> dict[str, float]:
    """Bytes one rank of stage pp_rank holds of the model's state at cfg's optim.zero (see the
    module doc): "weights", "grads", "optimizer" (what it keeps between steps, the weights'
    bf16 copies aside), "buffers" (the routing biases), "gathered" (what a step adds) and
    "experts" (the experts' part of the first three)."""
    zero, bf16 = cfg.optim.zero, cfg.train.bf16_autocast
    params = local_parameter_count(cfg, derived, pp_rank)
    experts = stage_moe_layers(derived, pp_rank) * local_parameters(cfg, derived, experts_only=True)
    dp = derived.dp * derived.cp
    edp = max(1, dp // derived.ep)  # the ranks that hold the same experts
    outside = tp_summed_grad_count(cfg, derived, pp_rank)
    last, first = pp_rank == derived.pp - 1, pp_rank == 0
    vocab = derived.padded_vocab_size // derived.tp * cfg.model.d_model
    if derived.pp > 1 and derived.last_stage_embedding and (first or last):
        outside += vocab
    dense_whole, expert_whole = whole_under_zero(cfg, derived, pp_rank)  # Muon's, under ZeRO
    outside += dense_whole
    frozen = expert_outside = 0  # the experts' adapters summed over tp: outside the buckets
    if cfg.model.lora is not None:  # the adapters train; the frozen base is weights alone
        frozen, (params, outside) = params, adapter_counts(cfg, derived, pp_rank)
        experts, summed = expert_adapter_counts(cfg, derived, pp_rank)  # whole: outside buckets
        outside, expert_outside = outside - summed, summed
    buffered = params - experts - outside

    def kept(level: int, whole_outside: bool = True) -> tuple[float, float]:
        """(elements, expert elements) kept when zero >= level shards them."""
        if zero < level:
            return params, experts
        rest = outside if whole_outside else outside / dp
        whole = expert_whole + expert_outside
        mine = (experts - whole) / edp + whole / (1 if whole_outside else edp)
        return buffered / dp + rest + mine, mine

    weights, expert_weights = kept(3)
    grads, expert_grads = kept(2)
    state, expert_state = kept(1, whole_outside=False)
    reduced = buffered + experts - expert_whole - expert_outside
    gathered = _reduction_bytes(cfg, reduced) / 4 if dp > 1 else 0.0
    if zero == 3 and dp > 1:
        gathered += _zero3_gathered(cfg, derived, pp_rank, vocab, buffered + experts)
    fp8_params = fp8_layer_params(cfg, derived, pp_rank)
    muon = local_elements(stage_matrices(cfg, derived, pp_rank), derived.tp)
    if zero:  # each rank keeps the momentum of the matrices it owns
        muon = dense_whole / dp + expert_whole / edp
    copies = 2 * (params + frozen - fp8_params) if bf16 else 0
    copies -= bf16_held_saving(cfg, derived, pp_rank)  # LoRA's frozen weights held in bf16
    casts = 2 * fp8_params - frozen_input_casts(cfg, derived, pp_rank)  # fp8.gemm keeps them
    fp8, biased = cfg.train.precision == "fp8", cfg.model.moe.router == "sigmoid"
    return {
        "weights": (weights + frozen) * 4 + copies + casts,
        "grads": grads * 4,
        "optimizer": state * 8 - muon * 4,  # Muon: one fp32 momentum, AdamW two moments
        "buffers": stage_moe_layers(derived, pp_rank) * cfg.model.moe.num_experts * 4 * biased,
        "gathered": gathered * 4,
        "experts": (expert_weights + expert_grads) * 4
        + expert_state * (4 if cfg.optim.name == "muon" else 8)
        + (2 * experts if bf16 or fp8 else 0),  # their bf16 copies, or their fp8 casts
    }


def _zero3_gathered(
    cfg: Config, derived: Derived, pp_rank: int, vocab: int, sharded: float
) -> float:
    """Elements ZeRO-3 gathers for a step beside the reduction: every sharded one under pp,
    else two layers' and the head's."""
    if derived.pp > 1:
        return sharded
    layer = local_layer_params(cfg, derived, moe=stage_moe_layers(derived, pp_rank) > 0)
    # kept from forward to backward: the output layer, the MTP modules and (untied) the
    # token embedding they look up in (data_parallel.param_shards: the last module's)
    lookups = vocab if cfg.model.mtp_depth and not derived.tie_embeddings else 0
    last = pp_rank == derived.pp - 1
    head = vocab + mtp_params(cfg, derived, pp_rank) + lookups if last else 0
    return 2 * layer + head


def fp8_layer_params(cfg: Config, derived: Derived, pp_rank: int) -> int:
    """Parameters of stage pp_rank's fp8 layers on one rank (0 unless train.precision is fp8):
    each block's attention projections and its dense MLP, or its MoE layer's shared and routed
    experts (model.precision.fp8_layers and fp8_moe_layers: all but the norms and the router),
    weights and biases."""
    if cfg.train.precision != "fp8":
        return 0
    model, norms = cfg.model, norm.block_parameters(cfg.model)
    dense = sum(
        local_layer_params(cfg, derived, index=i) - norms
        - attention_at(model, i).fp8_exempt(model, derived)
        for i in stage_blocks(derived, pp_rank)
    )  # fmt: skip
    moe = local_layer_params(cfg, derived, moe=True) - local_layer_params(cfg, derived)
    return dense + stage_moe_layers(derived, pp_rank) * (moe - router_params(cfg))


def _reduction_bytes(cfg: Config, buffered: float) -> float:
    """The bytes a step's gradient reductions hold beyond the kept gradients, for `buffered`
    elements in buckets: ZeRO-2 and 3 up to IN_FLIGHT + 1 bucket-sized tensors in flight (fp32;
    with optim.grad_reduce_dtype bf16 their bf16 copies and the fp32 bucket being filled);
    ZeRO-0 and 1 reduce the kept buffer in place, or in bf16 up to IN_FLIGHT + 1 bf16 copies."""
    bucket = cfg.optim.bucket_mb * 2**18  # elements
    bf16 = cfg.optim.grad_reduce_dtype == "bf16"
    if cfg.optim.zero >= 2:
        copies = min(buffered, (IN_FLIGHT + 1) * bucket)
        return copies * 2 + min(buffered, bucket) * 4 if bf16 else copies * 4
    return min(buffered, (IN_FLIGHT + 1) * bucket) * 2 if bf16 else 0.0
