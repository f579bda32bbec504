"""`megatronish plan`: per-rank memory, FLOPs and communication of a config at each layout, and
the layout to use, computed from formulas without starting anything.

The formulas are megatronish.accounting's: memory and step time per rank (accounting.memory,
whose docstring has them), communication (accounting.collectives), model FLOPs
(accounting.flops), the GPUs (accounting.hardware). This module searches the layouts and prints
the table. `ring` in the table is the ring attention's transfer time / block compute time
(<= 1: hidden). cp > 1 is searched where every rank keeps at least MIN_CP_TOKENS tokens of a
sequence.
"""

from __future__ import annotations

from megatronish.accounting.hardware import GPU_LINK_GB_S, GPU_MEMORY_GB, GPU_PEAK_TFLOPS
from megatronish.accounting.memory import ASSUMED_MFU, estimate
from megatronish.config import Config, world_size_of
from megatronish.errors import UserError

MIN_CP_TOKENS = 1024
HEADROOM = 0.90  # plan to use at most 90% of the device memory (allocator, NCCL, kernels)


def expert_degrees(cfg: Config, dp: int) -> list[int]:
    """The ep degrees plan tries at data-parallel degree dp: those dividing dp and the expert
    count (1 without experts)."""
    experts = cfg.model.moe.num_experts
    if experts == 0:
        return [1]
    return [ep for ep in range(1, dp + 1) if dp % ep == 0 and experts % ep == 0]


def gpu_spec(gpu: str | None, memory_gb: float | None) -> tuple[str, float, float]:
    """(name, memory GB, dense bf16 peak FLOP/s) of a GPU name such as H100 (default H100)."""
    name = (gpu or "H100").upper()
    if name not in GPU_MEMORY_GB:
        raise UserError(f"--gpu {gpu}: unknown GPU; valid: {', '.join(GPU_MEMORY_GB)}")
    if memory_gb is not None and memory_gb <= 0:
        raise UserError(f"--gpu-memory {memory_gb}: must be > 0 (GB)")
    return name, memory_gb or GPU_MEMORY_GB[name], GPU_PEAK_TFLOPS[name] * 1e12


def candidate_layouts(cfg: Config, world: int) -> list[tuple[int, int, int]]:
    """(tp, cp, pp): tensor-parallel degrees up to 8 (one node's fast links) that divide the
    heads, the kv heads and d_ff; context-parallel degrees up to 8 that split the sequence into
    2 cp chunks and leave every rank at least MIN_CP_TOKENS tokens (and, with tp, a multiple of
    tp); pipeline degrees up to 8 with a layer for every stage; whose product divides the
    world and leaves a dp that divides the global batch."""
    n_kv = cfg.model.n_kv_head or cfg.model.n_head
    s = cfg.train.seq_len
    out = []
    for tp in (1, 2, 4, 8):
        if cfg.model.n_head % tp or n_kv % tp:
            continue
        if cfg.model.d_ff is not None and cfg.model.d_ff % tp:
            continue
        for cp in (1, 2, 4, 8):
            if cp > 1 and (s % (2 * cp) or s // cp < MIN_CP_TOKENS or (s // cp) % tp):
                continue
            for pp in (1, 2, 4, 8):
                if world % (tp * cp * pp) or pp > cfg.model.n_layer:
                    continue
                dp = world // (tp * cp * pp)
                if cfg.train.global_batch_size % (cfg.train.micro_batch_size * dp):
                    continue
                out.append((tp, cp, pp))
    return out


def plan(cfg: Config, gpus: int | None, gpu: str | None, memory_gb: float | None) -> str:
    """The report `megatronish plan` prints."""
    if cfg.model.vocab_size is None:
        raise UserError("model.vocab_size: plan needs it set (--set model.vocab_size=N)")
    world = gpus if gpus is not None else world_size_of(cfg)
    if world < 1:
        raise UserError(f"--gpus {gpus}: must be >= 1")
    name, mem, peak = gpu_spec(gpu, memory_gb)
    layouts = candidate_layouts(cfg, world)
    if not layouts:
        raise UserError(
            f"no tensor-parallel degree in 1, 2, 4, 8 fits {world} GPUs with model.n_head="
            f"{cfg.model.n_head} and train.global_batch_size={cfg.train.global_batch_size}"
        )
    budget = mem * HEADROOM
    link = GPU_LINK_GB_S[name]
    rows, choice = [], None
    # With a fused attention kernel selective recompute keeps what no recompute keeps (the
    # s x s scores are never stored), so the fallback when nothing fits is full recompute.
    levels = (
        ["full"]
        if cfg.train.activation_checkpointing == "full"
        else [
            cfg.train.activation_checkpointing,
            "full",
        ]
    )
    moe = cfg.model.moe.num_experts > 0
    for recompute in levels:
        level = [
            estimate(
                cfg, world, tp, peak, pp, cp, link, ep, activation_checkpointing=recompute, zero=1
            )
            for tp, cp, pp in layouts
            for ep in expert_degrees(cfg, world // (tp * cp * pp))
        ]
        rows += level
        fits = [e for e in level if e.total_gb <= budget]
        if fits:  # the fastest that fits; among equals, the least model parallelism
            choice = min(
                fits, key=lambda e: (round(e.step_time_s, 6), e.tp * e.cp * e.pp, e.pp, e.cp)
            )
            break
    lines = [
        f"plan for {world} x {name} ({mem:.0f} GB each, bf16 peak {peak / 1e12:.0f} TFLOP/s; "
        f"step time assumes {ASSUMED_MFU:.0%} MFU)",
        "",
        f"{'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3} "
        + (f"{'ep':>3} {'experts GB':>10} " if moe else "")
        + f"{'bubble':>6} {'v':>2} {'ring':>5} {'sp':>3} "
        f"{'recompute':>9} "
        f"{'weights':>8} {'grads':>7} {'adam':>7} {'activ.':>8} {'logits':>7} {'total GB':>9} "
        f"{'comm GB':>8} {'compute s':>9}",
    ]
    for e in rows:
        mark = "  <- fits" if e.total_gb <= budget else ""
        ring = "-" if e.ring_ratio is None else f"{e.ring_ratio:.2f}"
        experts = f"{e.ep:>3} {e.expert_gb:>10.2f} " if moe else ""
        lines.append(
            f"{e.tp:>3} {e.cp:>3} {e.dp:>4} {e.pp:>3} {experts}{e.bubble:>6.2f} {e.pp_virtual:>2} "
            f"{ring:>5} "
            f"{'y' if e.sequence_parallel else 'n':>3} "
            f"{e.activation_checkpointing:>9} {e.weights_gb:>8.2f} {e.grads_gb:>7.2f} "
            f"{e.optimizer_gb:>7.2f} {e.activations_gb:>8.2f} {e.logits_gb:>7.2f} "
            f"{e.total_gb:>9.2f} {e.comm_gb_per_step:>8.2f} {e.step_time_s:>9.2f}{mark}"
        )
    lines.append("")
    if choice is None:
        lines.append(
            f"does not fit: no layout stays under {budget:.0f} GB per GPU; use more GPUs, a "
            "smaller train.micro_batch_size or a GPU with more memory"
        )
    else:
        lines.append(
            f"recommended: --set parallel.tp={choice.tp} --set parallel.cp={choice.cp} "
            f"--set parallel.dp={choice.dp} --set parallel.pp={choice.pp} "
            + (f"--set parallel.ep={choice.ep} " if moe else "")
            + ""
            + (f"--set parallel.pp_virtual={choice.pp_virtual} " if choice.pp_virtual > 1 else "")
            + f"--set parallel.sequence_parallel={str(choice.sequence_parallel).lower()} "
            f"--set optim.zero={choice.zero} "
            f"--set train.activation_checkpointing={choice.activation_checkpointing} "
            f"({choice.total_gb:.1f} GB per GPU, ~{choice.step_time_s:.2f} s of compute per step)"
        )
    return "\n".join(lines)
