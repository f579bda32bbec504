"""`megatronish check`: the resolved config and its derived sizes, without starting anything."""

from __future__ import annotations

import yaml

from megatronish.accounting.collectives import collectives_per_step
from megatronish.accounting.flops import model_flops_per_step
from megatronish.accounting.memory import model_state_bytes
from megatronish.accounting.parameters import (
    approx_tp_rank_parameters,
    local_moe_params,
    local_parameter_count,
    parameter_count,
    stage_moe_layers,
)
from megatronish.config import (
    Config,
    check_dataset_vocab,
    check_output_paths,
    derive,
    world_size_of,
)
from megatronish.errors import UserError


def data_vocab_size(cfg: Config) -> int:
    """The vocabulary of the data a config trains on: its dataset's (read and checked against
    model.vocab_size), or the byte vocabulary of the built-in corpus when data.path is unset."""
    return _data_facts(cfg)[1]


def _data_facts(cfg: Config) -> tuple[Config, int, bool]:
    """(cfg as its data settles it, as training settles it (data.sources.run_data);
    data_vocab_size; whether the data masks the loss: SFT data or data.eod_mask_loss)."""
    from megatronish.data import ByteTokenizer
    from megatronish.data.sources import run_data

    d = cfg.data
    if d.path is None and d.blend is None:
        return cfg, ByteTokenizer().vocab_size, d.eod_mask_loss
    cfg, data = run_data(cfg)
    check_dataset_vocab(cfg, data.vocab_size, data.sources[0].path)
    return cfg, data.vocab_size, data.sft or d.eod_mask_loss


def check_config(cfg: Config, world_size: int | None) -> str:
    """The report `check` prints. world_size defaults to tp * cp * pp * (parallel.dp or 1). A
    model.* key that differs from the checkpoint the run would resume from is a UserError, as
    in `train`."""
    from megatronish import ops
    from megatronish.distributed.layout import default_device
    from megatronish.training.resume import check_resumed_model

    if world_size is not None and world_size < 1:
        raise UserError(f"--world-size {world_size}: must be >= 1")
    ops.check_backend(cfg.kernels.backend, default_device())
    check_output_paths(cfg)
    if cfg.observe.tensorboard:
        from megatronish.observe.tensorboard import check_available

        check_available()
    if world_size is None:
        world_size = world_size_of(cfg)
    cfg, vocab_size, loss_masked = _data_facts(cfg)
    d = derive(cfg, world_size, vocab_size=vocab_size)
    check_resumed_model(cfg, d.vocab_size)  # a changed model.* key: the line train would say
    params = parameter_count(cfg, d)
    lines = [
        "# resolved config",
        yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(),
        "",
        "# derived",
        f"world_size: {d.world_size}  (tp {d.tp} x cp {d.cp} x dp {d.dp}"
        + (f" (ep {d.ep} inside)" if d.ep > 1 else "")
        + f" x pp {d.pp}, tp innermost)",
        f"parameters: {params:,} ({params / 1e6:.2f} M)",
        f"parameters per tp rank: ~{approx_tp_rank_parameters(cfg, d, params):,}",
        f"gradient accumulation steps: {d.grad_accum_steps}",
        f"tokens per step (global batch): {d.tokens_per_step:,}",
        f"heads per tp rank: {cfg.model.n_head // d.tp} query, {d.n_kv_head // d.tp} kv"
        f" (head dim {d.head_dim})",
        f"d_ff: {d.d_ff} ({d.d_ff // d.tp} per tp rank)",
        f"vocab: {d.vocab_size}, padded to {d.padded_vocab_size} "
        f"({d.padded_vocab_size // d.tp} per tp rank)",
        f"tie_embeddings: {str(d.tie_embeddings).lower()}",
        f"model FLOPs per step (global batch, all ranks): {model_flops_per_step(cfg, d):.3e} FLOP",
    ]
    lines += zero_lines(cfg, d, loss_masked)
    if d.moe_layers:
        lines += moe_lines(cfg, d, params)
    if d.cp > 1:
        lines += context_lines(cfg, d)
    if d.pp > 1:
        lines += pipeline_lines(cfg, d)
    return "\n".join(lines + ["ok"])


def zero_lines(cfg: Config, d, loss_masked: bool) -> list[str]:
    """The model state a rank holds at optim.zero (of the fullest stage) and the bytes of its
    data-parallel collectives per step, by kind (ZeRO-3's gathers included)."""
    states = [model_state_bytes(cfg, d, r) for r in range(d.pp)]
    st = max(states, key=lambda x: x["weights"] + x["grads"] + x["optimizer"] + x["gathered"])
    mib = 2**20
    line = (
        f"model state per rank (optim.zero={cfg.optim.zero}, fullest stage): weights "
        f"{st['weights'] / mib:.2f} MiB, gradients {st['grads'] / mib:.2f} MiB, AdamW "
        f"{st['optimizer'] / mib:.2f} MiB"
    )
    if st["gathered"]:
        line += (
            f"; a step adds up to {st['gathered'] / mib:.2f} MiB (buckets gathered or in flight)"
        )
    kinds: dict[str, int] = {}
    for op in collectives_per_step(cfg, d, loss_masked=loss_masked):
        if op.group == "dp":
            kinds[op.kind] = kinds.get(op.kind, 0) + op.payload * op.count
    traffic = ", ".join(f"{kind} {size / mib:.2f} MiB" for kind, size in sorted(kinds.items()))
    return [line, f"data-parallel payload per step and rank (stage 0): {traffic or 'none'}"]


def moe_lines(cfg: Config, d, params: int) -> list[str]:
    """Total and active parameters, the experts each ep rank holds, the all-to-all traffic."""
    moe = cfg.model.moe
    active = parameter_count(cfg, d, active=True)
    layers = ", ".join(str(i) for i in d.moe_layers)
    local = max(stage_moe_layers(d, r) for r in range(d.pp)) * local_moe_params(cfg, d, True)
    a2a = [op for op in collectives_per_step(cfg, d) if op.kind == "all_to_all"]
    sent = sum(op.sent for op in a2a)
    route = "dropless" if moe.capacity_factor is None else f"capacity factor {moe.capacity_factor}"
    return [
        f"mixture of experts: {moe.num_experts} experts (top {moe.top_k}, d_ff {d.moe_d_ff}, "
        f"router {moe.router}, {route}) in blocks {layers}",
        f"parameters: {params:,} total, {active:,} active per token ({100 * active / params:.0f}%)",
        f"experts per ep rank: {moe.num_experts // d.ep} (ep {d.ep}); expert parameters per "
        f"rank: ~{local:,} ({local * 16 / 2**20:.1f} MiB of fp32 weights, grads and AdamW)",
        f"all-to-all per step and rank (ep {d.ep}): "
        + (
            f"{sum(op.payload * op.count for op in a2a) / 2**20:.2f} MiB payload, "
            f"{sent / 2**20:.2f} MiB sent"
            if a2a
            else "none (ep 1)"
        ),
    ]


def context_lines(cfg: Config, d) -> list[str]:
    """The zigzag split each cp rank holds."""
    s, cp = cfg.train.seq_len, d.cp
    chunk = s // (2 * cp)
    return [
        f"context parallel: {cp} ranks, {s // cp} tokens of every sequence each: chunks r and "
        f"{2 * cp - 1} - r of {2 * cp} chunks of {chunk} tokens (zigzag), ring attention",
    ]


def pipeline_lines(cfg: Config, d) -> list[str]:
    """The stage split (with pp_virtual > 1: each stage's model chunks), each stage's parameters
    per rank and the schedule's bubble."""
    m, v = d.grad_accum_steps, d.pp_virtual
    per_stage = ", ".join(f"{local_parameter_count(cfg, d, r):,}" for r in range(d.pp))
    stages = f"pipeline stages: {d.pp} (layers {', '.join(str(n) for n in d.stage_layers)}), "
    params = f"parameters per rank by stage (padded vocab): {per_stage}"
    if v == 1:
        lines = [
            stages + f"schedule {cfg.parallel.pp_schedule}",
            params,
            f"bubble (p - 1) / m = {d.pp - 1} / {m} = {(d.pp - 1) / m:.2f} of the ideal step time",
        ]
    else:
        lines = [
            stages + f"schedule {cfg.parallel.pp_schedule} interleaved, {v} model chunks a stage",
            *chunk_lines(cfg, d),
            params,
            f"bubble (p - 1) / (v x m) = {d.pp - 1} / ({v} x {m}) = "
            f"{(d.pp - 1) / (v * m):.2f} of the ideal step time",
        ]
    if m < d.pp:
        lines.append(
            f"note: {m} micro-batches for {d.pp} stages leaves stages idle most of the step; "
            "raise train.global_batch_size or lower train.micro_batch_size"
        )
    return lines


def chunk_lines(cfg: Config, d) -> list[str]:
    """Each stage's model chunks (their global layers) and the most (micro-batch, chunk)
    activations it holds under the interleaved schedule."""
    from megatronish.pipeline.schedule import warmup_forwards

    def layers(span: range) -> str:
        return str(span[0]) if len(span) == 1 else f"{span[0]}-{span[-1]}"

    m, v, schedule = d.grad_accum_steps, d.pp_virtual, cfg.parallel.pp_schedule
    chunks = "; ".join(
        f"{r}: " + ", ".join(layers(span) for span in d.stage_chunks(r)) for r in range(d.pp)
    )
    held = ", ".join(
        str(min(warmup_forwards(d.pp, v, m, r, schedule) + 1, m * v)) for r in range(d.pp)
    )
    return [
        f"model chunks by stage (global layers): {chunks}",
        f"activations held at most by stage ((micro-batch, chunk) pairs): {held}",
    ]
