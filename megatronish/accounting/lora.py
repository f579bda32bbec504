"""The LoRA adapters' parameters on one rank (model.lora: megatronish.layers.lora), what a LoRA
run trains: its gradients, optimizer state and data-parallel reductions count these alone, the
frozen base only its weights (accounting.memory, accounting.collectives.dp).

Per target of a block, r the rank, t tp, d d_model: a column-parallel projection of `rows`
output rows (q_proj n_head x head_dim, k_proj and v_proj n_kv_head x head_dim, gate_proj and
up_proj d_ff) holds A r x d whole (its gradient summed over tp at t > 1) and B rows / t x r; a
row-parallel one of `cols` inputs (o_proj n_head x head_dim, down_proj d_ff) holds A r x cols / t
and B d x r whole (summed over tp under sequence parallelism at t > 1). The experts' targets
(moe.adapters), per local expert of a MoE block, f its d_ff: experts.gate_up_proj A r x d whole
(summed over tp at t > 1) and B 2 f / t x r; experts.down_proj A r x f / t and B d x r whole
(summed over tp at t > 1); their gradients reduced over the expert-data-parallel group."""

from __future__ import annotations

from megatronish.accounting.parameters import stage_blocks, stage_moe_layers
from megatronish.config import Config, Derived


def block_targets(cfg: Config, derived: Derived, index: int) -> tuple[dict, dict]:
    """({column-parallel target: its output rows}, {row-parallel target: its inputs}) of the
    targets of model.lora that block `index` has (empty without model.lora)."""
    lora, model, head_dim = cfg.model.lora, cfg.model, derived.head_dim
    columns, rows = {}, {}
    if lora is None:
        return columns, rows
    if model.block_attention(index) == "mha":
        kv = derived.n_kv_head * head_dim
        columns |= {"q_proj": model.n_head * head_dim, "k_proj": kv, "v_proj": kv}
        rows |= {"o_proj": model.n_head * head_dim}
    d_ff = derived.shared_d_ff if index in derived.moe_layers else derived.d_ff
    if d_ff:
        gated = model.components.gated_mlp
        columns |= {"up_proj": d_ff} | ({"gate_proj": d_ff} if gated else {})
        rows |= {"down_proj": d_ff}
    targets = set(lora.targets)
    return (
        {n: v for n, v in columns.items() if n in targets},
        {n: v for n, v in rows.items() if n in targets},
    )


def adapter_counts(cfg: Config, derived: Derived, pp_rank: int = 0) -> tuple[int, int]:
    """(adapter parameters one tp rank of stage pp_rank holds, those of them whose gradient is
    summed over tp first); (0, 0) without model.lora. Multi-token prediction blocks are not
    counted."""
    if cfg.model.lora is None:
        return 0, 0
    counts = [_dense_adapters(cfg, derived, i) for i in stage_blocks(derived, pp_rank)]
    experts, experts_summed = expert_adapter_counts(cfg, derived, pp_rank)
    return (
        sum(total for total, _ in counts) + experts,
        sum(summed for _, summed in counts) + experts_summed,
    )


def _dense_adapters(cfg: Config, derived: Derived, index: int) -> tuple[int, int]:
    """(block `index`'s adapter parameters on one tp rank but the experts', those of them
    whose gradient is summed over tp first)."""
    t, r, d = derived.tp, cfg.model.lora.rank, cfg.model.d_model
    row_summed = cfg.parallel.sequence_parallel and t > 1
    columns, rows = block_targets(cfg, derived, index)
    total = sum(r * d + out // t * r for out in columns.values())
    total += sum(r * inputs // t + d * r for inputs in rows.values())
    summed = len(columns) * r * d if t > 1 else 0
    return total, summed + (len(rows) * d * r if row_summed else 0)


def _layer_expert_adapters(cfg: Config, derived: Derived) -> tuple[int, int]:
    """(the experts' adapter parameters of one MoE layer on one tp and ep rank, those of them
    whose gradient is summed over tp first); (0, 0) without expert targets."""
    lora = cfg.model.lora
    targets = set(lora.targets) if lora is not None else set()
    if not targets & {"experts.gate_up_proj", "experts.down_proj"}:
        return 0, 0
    t, r, d, f = derived.tp, lora.rank, cfg.model.d_model, derived.moe_d_ff
    total = summed = 0
    if "experts.gate_up_proj" in targets:
        total, summed = r * d + 2 * (f // t) * r, r * d
    if "experts.down_proj" in targets:
        total, summed = total + r * (f // t) + d * r, summed + d * r
    experts = cfg.model.moe.num_experts // derived.ep
    return total * experts, (summed if t > 1 else 0) * experts


def adapter_parameters(cfg: Config, derived: Derived) -> int:
    """The adapters' parameters in the whole model (every block, unsplit): what their GEMMs
    take per token (accounting.flops); 0 without model.lora."""
    lora, d = cfg.model.lora, cfg.model.d_model
    if lora is None:
        return 0
    total = 0
    for index in range(cfg.model.n_layer):
        columns, rows = block_targets(cfg, derived, index)
        total += sum(lora.rank * (d + n) for n in [*columns.values(), *rows.values()])
    return total


def bf16_held_weights(cfg: Config, derived: Derived, pp_rank: int = 0) -> tuple[int, int]:
    """(frozen weights one tp rank of stage pp_rank holds in bf16 alone, those of them in fp8
    layers) under model.lora with bf16 autocast (model.adapters.freeze_base; else (0, 0)): the
    weights of the blocks' mha attention projections and dense MLPs (fp8 layers under fp8) and
    of the untied output layer. The linear layers of MLA, Gated DeltaNet and multi-token
    prediction blocks are held so too but not counted here (plan over-counts them 4 bytes)."""
    if cfg.model.lora is None or not cfg.train.bf16_autocast:
        return 0, 0
    model, t, d, head_dim = cfg.model, derived.tp, cfg.model.d_model, derived.head_dim
    blocks = 0
    for index in stage_blocks(derived, pp_rank):
        if model.block_attention(index) == "mha":
            q, kv = model.n_head * head_dim, derived.n_kv_head * head_dim
            blocks += (2 * q + 2 * kv) * d // t
        d_ff = derived.shared_d_ff if index in derived.moe_layers else derived.d_ff
        blocks += (3 if model.components.gated_mlp else 2) * d_ff * d // t
    last = pp_rank == derived.pp - 1 and not derived.tie_embeddings
    head = derived.padded_vocab_size // t * d if last else 0
    return blocks + head, blocks if cfg.train.precision == "fp8" else 0


def bf16_held_saving(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Bytes the bf16_held_weights save against fp32 weights with their bf16 copies (an fp8
    layer's: with its fp8 casts, no copy): 4 a weight, 2 an fp8 layer's."""
    held, fp8 = bf16_held_weights(cfg, derived, pp_rank)
    return 4 * held - 2 * fp8


def expert_adapter_counts(cfg: Config, derived: Derived, pp_rank: int = 0) -> tuple[int, int]:
    """(the experts' adapter parameters one tp and ep rank of stage pp_rank holds, those of
    them whose gradient is summed over tp first); (0, 0) without expert targets."""
    total, summed = _layer_expert_adapters(cfg, derived)
    layers = stage_moe_layers(derived, pp_rank)
    return total * layers, summed * layers


def last_block_buffered(cfg: Config, derived: Derived, pp_rank: int = 0) -> tuple[int, int]:
    """(dense, expert) adapter parameters in ZeRO's buffers (those whose gradient is not
    summed over tp first) of the last block of stage pp_rank that has any: under ZeRO-3 the
    last module with parameters in the buffers, which keeps them gathered from its forward to
    its backward (data_parallel.param_shards). (0, 0) without model.lora."""
    if cfg.model.lora is None:
        return 0, 0
    expert, expert_summed = _layer_expert_adapters(cfg, derived)
    for index in reversed(stage_blocks(derived, pp_rank)):
        total, summed = _dense_adapters(cfg, derived, index)
        experts = expert - expert_summed if index in derived.moe_layers else 0
        if total - summed or experts:
            return total - summed, experts
    return 0, 0


QKV = ("q_proj", "k_proj", "v_proj")


def frozen_inputs(cfg: Config, derived: Derived, pp_rank: int = 0) -> set[str]:
    """The first block's layers (qkv, proj, mlp_in: gate and up, down) whose input gradient a
    LoRA run does not compute: on the first stage nothing before the first adapter needs a
    gradient (the embedding is frozen): qkv's always, the attention projection's where q, k and
    v have no adapter, the MLP's first projections' where the attention has none, and down's
    where neither has, nor gate or up. Empty on other stages and without model.lora."""
    blocks = stage_blocks(derived, pp_rank)
    if cfg.model.lora is None or pp_rank != 0 or not blocks:
        return set()
    columns, rows = block_targets(cfg, derived, blocks[0])
    qkv = bool(set(columns) & set(QKV))
    attention = qkv or "o_proj" in rows  # the attention's output needs a gradient
    mlp_in = attention or bool(set(columns) - set(QKV))
    conditions = {"qkv": True, "proj": not qkv, "mlp_in": not attention, "down": not mlp_in}
    return {layer for layer, frozen in conditions.items() if frozen}


def frozen_input_casts(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Elements of the fp8 input-gradient weight casts (megatronish.fp8.gemm) that a LoRA run
    does not make: those of the first block's ``frozen_inputs`` layers (dense ones; 0 unless
    train.precision is fp8 and the block's attention is mha)."""
    frozen = frozen_inputs(cfg, derived, pp_rank)
    model, t = cfg.model, derived.tp
    if cfg.train.precision != "fp8" or not frozen or model.block_attention(0) != "mha":
        return 0
    d, q = model.d_model, model.n_head * derived.head_dim
    kv = derived.n_kv_head * derived.head_dim
    d_ff = 0 if 0 in derived.moe_layers else derived.d_ff
    sizes = {
        "qkv": (q + 2 * kv) * d,
        "proj": q * d,
        "mlp_in": (2 if model.components.gated_mlp else 1) * d_ff * d,
        "down": d_ff * d,
    }
    return sum(sizes[layer] for layer in frozen) // t
