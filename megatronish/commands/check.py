"""`megatronish check`: the resolved config and its derived sizes, without starting anything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from megatronish.accounting.collectives import Purpose, Split, collectives_per_step
from megatronish.accounting.components import gated_deltanet
from megatronish.accounting.components.moe import local_parameters
from megatronish.accounting.flops import model_flops_per_step
from megatronish.accounting.memory import decode_cache_elements
from megatronish.accounting.model_state import model_state_bytes
from megatronish.accounting.muon import (
    STATE_LABEL,
    gather_payload,
    local_elements,
    stage_matrices,
    step_flops,
)
from megatronish.accounting.parameters import (
    approx_tp_rank_parameters,
    local_parameter_count,
    parameter_count,
    stage_moe_layers,
)
from megatronish.commands.dpo_pass import reference_pass_lines
from megatronish.config import (
    Config,
    Derived,
    check_dataset_vocab,
    check_output_paths,
    derive,
    layout_notes,
    world_size_of,
)
from megatronish.errors import UserError


def data_vocab_size(cfg: Config) -> int:
    """The vocabulary of the data a config trains on: its dataset's (read and checked against
    model.vocab_size), or the byte vocabulary of the built-in corpus when data.path is unset."""
    return _data_facts(cfg)[1]


def _refused(note: Callable[[str], None] | None, check: Callable[..., Any], *args: Any) -> None:
    """check(*args); with note, a UserError it raises (what train would refuse) is a note."""
    try:
        check(*args)
    except UserError as refusal:
        if note is None:
            raise
        note(f"note: train would refuse this config: {refusal}")


def _data_facts(
    cfg: Config, start_tokenizer: bool = False, note: Callable[[str], None] | None = None
) -> tuple[Config, int, bool]:
    """(cfg as its data settles it, as training settles it (data.sources.run_data);
    data_vocab_size; whether the data masks the loss: SFT data or data.eod_mask_loss). With
    start_tokenizer, a dataset of a tokenizer the starting weights do not have is a UserError
    (train's; the built-in corpus is not opened to compare), or a note given note (_refused)."""
    from megatronish.data import ByteTokenizer
    from megatronish.data.sources import run_data
    from megatronish.training.resume import check_start_tokenizer

    data = cfg.data
    if data.path is None and data.blend is None:
        return cfg, ByteTokenizer().vocab_size, data.eod_mask_loss
    cfg, plan = run_data(cfg)
    if start_tokenizer:
        _refused(note, check_start_tokenizer, cfg, plan.sources)
    check_dataset_vocab(cfg, plan.vocab_size, plan.sources[0].path)
    return cfg, plan.vocab_size, plan.sft or data.eod_mask_loss


def check_config(
    cfg: Config, world_size: int | None, note: Callable[[str], None] | None = None
) -> str:
    """The report `check` prints. world_size defaults to tp * cp * pp * (parallel.dp or 1). A
    model.* key that differs from the checkpoint the run would resume from, or a dataset of
    another tokenizer than its (or checkpoint.init_from_hf's), is a UserError, as in `train`
    (launch checks with it before starting ranks); given note, it is a note line passed to note
    instead (`check` explores shapes: the report is still made)."""
    from megatronish import fp8, ops
    from megatronish.distributed.layout import default_device
    from megatronish.training.resume import check_resumed_model

    if world_size is not None and world_size < 1:
        raise UserError(f"--world-size {world_size}: must be >= 1")
    ops.check_backend(cfg.kernels.backend, default_device())
    fp8_note = (
        fp8.check_device(default_device(), cfg.kernels.backend)
        if cfg.train.precision == "fp8"
        else None
    )
    check_output_paths(cfg)
    if cfg.observe.tensorboard:
        from megatronish.observe.tensorboard import check_available

        check_available()
    if world_size is None:
        world_size = world_size_of(cfg)
    cfg, vocab_size, loss_masked = _data_facts(cfg, start_tokenizer=True, note=note)
    derived = derive(cfg, world_size, vocab_size=vocab_size)
    _refused(note, check_resumed_model, cfg, derived.vocab_size)  # a changed model.* key
    params = parameter_count(cfg, derived)
    lines = [
        "# resolved config",
        yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(),
        "",
        *derived_lines(cfg, derived, params),
    ]
    lines += zero_lines(cfg, derived, loss_masked) + optimizer_lines(cfg, derived)
    if fp8_note is not None:
        lines += fp8_lines(cfg, derived, fp8_note)
    lines += layout_notes(cfg, derived) + tp_overlap_lines(cfg, derived, loss_masked)
    if derived.moe_layers:
        lines += moe_lines(cfg, derived, params)
    if derived.cp > 1:
        lines += context_lines(cfg, derived)
    if derived.pp > 1:
        lines += pipeline_lines(cfg, derived)
    lines += reference_pass_lines(cfg, model_flops_per_step(cfg, derived))  # DPO's
    return "\n".join(lines + ["ok"])


def derived_lines(cfg: Config, derived: Derived, params: int) -> list[str]:
    """The report's `# derived` section: the layout, the model's sizes per tp rank, the batch and
    the model FLOPs per step."""
    return [
        "# derived",
        f"world_size: {derived.world_size}  (tp {derived.tp} x cp {derived.cp} x dp {derived.dp}"
        + (f" (ep {derived.ep} inside)" if derived.ep > 1 else "")
        + f" x pp {derived.pp}, tp innermost)",
        f"parameters: {params:,} ({params / 1e6:.2f} M)",
        f"parameters per tp rank: ~{approx_tp_rank_parameters(cfg, derived, params):,}",
        f"gradient accumulation steps: {derived.grad_accum_steps}",
        f"tokens per step (global batch): {derived.tokens_per_step:,}",
        _heads_line(cfg, derived),
        _cache_line(cfg, derived),
        f"d_ff: {derived.d_ff} ({derived.d_ff // derived.tp} per tp rank)",
        f"vocab: {derived.vocab_size}, padded to {derived.padded_vocab_size} "
        f"({derived.padded_vocab_size // derived.tp} per tp rank)",
        f"tie_embeddings: {str(derived.tie_embeddings).lower()}",
        "model FLOPs per step (global batch, all ranks): "
        f"{model_flops_per_step(cfg, derived):.3e} FLOP",
    ]


def zero_lines(cfg: Config, derived: Derived, loss_masked: bool) -> list[str]:
    """The model state a rank holds at optim.zero (of the fullest stage) and the bytes of its
    data-parallel collectives per step, by kind (ZeRO-3's gathers included)."""
    states = [model_state_bytes(cfg, derived, r) for r in range(derived.pp)]
    st = max(states, key=lambda x: x["weights"] + x["grads"] + x["optimizer"] + x["gathered"])
    mib = 2**20
    line = (
        f"model state per rank (optim.zero={cfg.optim.zero}, fullest stage): weights "
        f"{st['weights'] / mib:.2f} MiB, gradients {st['grads'] / mib:.2f} MiB, "
        f"{STATE_LABEL[cfg.optim.name]} "
        f"{st['optimizer'] / mib:.2f} MiB"
    )
    if st["buffers"]:
        line += f", routing biases {st['buffers'] / mib:.4f} MiB"
    if st["gathered"]:
        line += (
            f"; a step adds up to {st['gathered'] / mib:.2f} MiB (buckets gathered or in flight)"
        )
    kinds: dict[str, int] = {}
    for op in collectives_per_step(cfg, derived, loss_masked=loss_masked):
        if op.group == "dp":
            kinds[op.kind] = kinds.get(op.kind, 0) + op.payload * op.count
    traffic = ", ".join(f"{kind} {size / mib:.2f} MiB" for kind, size in sorted(kinds.items()))
    return [line, f"data-parallel payload per step and rank (stage 0): {traffic or 'none'}"]


def optimizer_lines(cfg: Config, derived: Derived) -> list[str]:
    """Under optim.name muon, which parameters each optimizer takes and Muon's costs on the
    rank of the stage with the most Muon matrices (accounting.muon)."""
    if cfg.optim.name != "muon":
        return []
    stages = [stage_matrices(cfg, derived, r) for r in range(derived.pp)]
    fullest = max(range(derived.pp), key=lambda r: local_elements(stages[r], derived.tp))
    matrices, tp = stages[fullest], derived.tp
    shapes = dict.fromkeys(f"{m.name} [{m.rows}, {m.cols}]" for s in stages for m in s)
    elements = local_elements(matrices, tp)
    rest = local_parameter_count(cfg, derived, fullest) - elements
    return [
        f"muon: {', '.join(shapes)} (each block's and each expert's apart); "
        f"{sum(m.count for m in matrices)} matrices, {elements:,} elements per rank (momentum "
        f"{4 * elements / 2**20:.2f} MiB); Newton-Schulz {step_flops(cfg, matrices):.3e} FLOP "
        f"per step and rank; tp all-gathers {gather_payload(matrices, tp) / 2**20:.2f} MiB "
        "per step",
        "adamw: the token embedding, the output layer, norms, biases, routers and the rest: "
        f"{rest:,} parameters per rank",
    ]


FP8_RECIPES = {
    "tensorwise": "one scale per tensor; e4m3 inputs and weights, e5m2 output gradients",
    "rowwise": "a power-of-two scale per row along the summed dimension; e4m3",
    "blockwise": "1 x 128 tiles of activations and gradients, 128 x 128 weight blocks; e4m3",
}


def fp8_lines(cfg: Config, derived: Derived, note: str) -> list[str]:
    """The fp8 recipe, what it covers, its amax all-reduces per step (stage 0) and the note
    that says it is emulated."""
    recipe = cfg.train.fp8_recipe
    ops = collectives_per_step(cfg, derived)
    amax = [op for op in ops if op.purpose is Purpose.FP8_AMAX]
    calls, payload = sum(op.count for op in amax), sum(op.payload * op.count for op in amax)
    return [
        f"fp8: {recipe} ({FP8_RECIPES[recipe]}) on the blocks' attention, dense MLP and MoE "
        "expert (routed and shared) GEMMs; embeddings, output layer and loss, norms, routers, "
        f"attention core in {cfg.train.fp8_high_precision}, weights and optimizer in fp32",
        f"fp8 amax all-reduces per step and rank (tp {derived.tp}, cp {derived.cp}, stage 0): "
        f"{calls} calls, {payload:,} bytes",
        note,
    ]


def tp_overlap_lines(cfg: Config, derived: Derived, loss_masked: bool) -> list[str]:
    """With parallel.tp_comm_overlap at tp > 1: the tp collectives decomposed under the GEMMs
    (megatronish.layers.overlap) and those left whole, by the names the collective count
    gives them (every stage's)."""
    t = derived.tp
    if not cfg.parallel.tp_comm_overlap or t == 1:
        return []
    ops = [
        op
        for r in range(derived.pp)
        for op in collectives_per_step(cfg, derived, r, loss_masked)
        if op.group == "tp"
    ]
    split = {op.what for op in ops if op.split is not Split.WHOLE}
    whole = {op.what for op in ops if op.split is Split.WHOLE}
    if cfg.parallel.sequence_parallel:
        hops = f"{t - 1} ring hop{'s' if t > 2 else ''}"
        how = f"each all-gather and reduce-scatter as {hops} of a 1/{t} sequence chunk"
    else:
        how = f"each all-reduce as {t} all-reduces of a 1/{t} sequence chunk"
    return [
        f"tp communication under the GEMMs (parallel.tp_comm_overlap), {how}: "
        + "; ".join(sorted(split)),
        "tp collectives left whole: " + "; ".join(sorted(whole)),
    ]


def moe_lines(cfg: Config, derived: Derived, params: int) -> list[str]:
    """Total and active parameters, the experts each ep rank holds, the all-to-all traffic (of
    a rank of the stage with the most MoE layers, the first of them: under pp the first stages
    may have none)."""
    moe = cfg.model.moe
    active = parameter_count(cfg, derived, active=True)
    layers = ", ".join(str(i) for i in derived.moe_layers)
    per_stage = [stage_moe_layers(derived, r) for r in range(derived.pp)]
    stage = per_stage.index(max(per_stage))
    local = per_stage[stage] * local_parameters(cfg, derived, True)
    a2a = [op for op in collectives_per_step(cfg, derived, stage) if op.kind == "all_to_all"]
    sent = sum(op.sent for op in a2a)
    where = f", stage {stage}: {per_stage[stage]} MoE layers" if derived.pp > 1 else ""
    route = "dropless" if moe.capacity_factor is None else f"capacity factor {moe.capacity_factor}"
    return [
        f"mixture of experts: {moe.num_experts} experts (top {moe.top_k}, d_ff {derived.moe_d_ff}, "
        f"router {moe.router}, {route}) in blocks {layers}",
        f"parameters: {params:,} total, {active:,} active per token ({100 * active / params:.0f}%)",
        f"experts per ep rank: {moe.num_experts // derived.ep} (ep {derived.ep}); expert "
        f"parameters per rank: ~{local:,} ({local * 16 / 2**20:.1f} MiB of fp32 weights, grads "
        "and AdamW)",
        f"all-to-all per step and rank (ep {derived.ep}{where}): "
        + (
            f"{sum(op.payload * op.count for op in a2a) / 2**20:.2f} MiB payload, "
            f"{sent / 2**20:.2f} MiB sent"
            if a2a
            else "none (ep 1)"
        ),
    ]


def context_lines(cfg: Config, derived: Derived) -> list[str]:
    """The zigzag split each cp rank holds."""
    seq_len, cp = cfg.train.seq_len, derived.cp
    chunk = seq_len // (2 * cp)
    return [
        f"context parallel: {cp} ranks, {seq_len // cp} tokens of every sequence each: chunks r "
        f"and {2 * cp - 1} - r of {2 * cp} chunks of {chunk} tokens (zigzag), ring attention",
    ]


def pipeline_lines(cfg: Config, derived: Derived) -> list[str]:
    """The stage split (with pp_virtual > 1: each stage's model chunks), each stage's parameters
    per rank and the schedule's bubble."""
    m, v, pp = derived.grad_accum_steps, derived.pp_virtual, derived.pp
    per_stage = ", ".join(f"{local_parameter_count(cfg, derived, r):,}" for r in range(pp))
    stages = f"pipeline stages: {pp} (layers {', '.join(str(n) for n in derived.stage_layers)}), "
    params = f"parameters per rank by stage (padded vocab): {per_stage}"
    if v == 1:
        lines = [
            stages + f"schedule {cfg.parallel.pp_schedule}",
            params,
            f"bubble (p - 1) / m = {pp - 1} / {m} = {(pp - 1) / m:.2f} of the ideal step time",
        ]
    else:
        lines = [
            stages + f"schedule {cfg.parallel.pp_schedule} interleaved, {v} model chunks a stage",
            *chunk_lines(cfg, derived),
            params,
            f"bubble (p - 1) / (v x m) = {pp - 1} / ({v} x {m}) = "
            f"{(pp - 1) / (v * m):.2f} of the ideal step time",
        ]
    if m < pp:
        lines.append(
            f"note: {m} micro-batches for {pp} stages leaves stages idle most of the step; "
            "raise train.global_batch_size or lower train.micro_batch_size"
        )
    return lines


def chunk_lines(cfg: Config, derived: Derived) -> list[str]:
    """Each stage's model chunks (their global layers) and the most (micro-batch, chunk)
    activations it holds under the interleaved schedule."""
    from megatronish.pipeline.schedule import warmup_forwards

    def layers(span: range) -> str:
        return str(span[0]) if len(span) == 1 else f"{span[0]}-{span[-1]}"

    m, v, schedule = derived.grad_accum_steps, derived.pp_virtual, cfg.parallel.pp_schedule
    chunks = "; ".join(
        f"{r}: " + ", ".join(layers(span) for span in derived.stage_chunks(r))
        for r in range(derived.pp)
    )
    held = ", ".join(
        str(min(warmup_forwards(derived.pp, v, m, r, schedule) + 1, m * v))
        for r in range(derived.pp)
    )
    return [
        f"model chunks by stage (global layers): {chunks}",
        f"activations held at most by stage ((micro-batch, chunk) pairs): {held}",
    ]


def _heads_line(cfg: Config, derived: Derived) -> str:
    """The attention heads one tp rank holds and their sizes (multi-head latent attention: the
    query-key and value head dims and the latent every head's keys and values come from)."""
    heads = cfg.model.n_head // derived.tp
    if cfg.model.attention == "mla":
        mla = cfg.model.mla
        return (
            f"heads per tp rank: {heads} (mla: query-key head dim {derived.head_dim} = "
            f"{mla.qk_nope_head_dim} + rotary {mla.qk_rope_head_dim}, value head dim "
            f"{derived.v_head_dim}; kv latent {mla.kv_lora_rank} + shared rotary key "
            f"{mla.qk_rope_head_dim})"
        )
    return (
        f"heads per tp rank: {heads} query, {derived.n_kv_head // derived.tp} kv "
        f"(head dim {derived.head_dim})"
    )


def _cache_line(cfg: Config, derived: Derived) -> str:
    """generate's decode cache per token on one tp rank, bf16 (and fp32), over the layers whose
    cache grows; and per sequence the fixed state and convolution tail of the linear-attention
    layers (model.layer_types), bf16 tail and fp32 state."""
    held, full = decode_cache_elements(cfg, derived)
    model = cfg.model
    linear = sum(model.block_attention(i) == "gated_deltanet" for i in range(model.n_layer))
    layers = model.n_layer - linear
    line = (
        f"decode cache per token and tp rank: {2 * held * layers:,} bytes bf16 "
        f"({4 * held * layers:,} fp32; {2 * held:,} bf16 per layer x {layers})"
    )
    if held != full:
        line += f"; full keys and values would be {2 * full * layers:,} bytes bf16"
    if linear:
        fixed = linear * gated_deltanet.state_bytes(model, derived, 2)
        line += f"; fixed per sequence {fixed:,} bytes (state and convolution tail x {linear})"
    return line
