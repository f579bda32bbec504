"""`megatronish bench`: times training steps and checks the bytes each rank sends per step
against the analytic count.

The run is the config's training run with evaluation and checkpointing switched off: W warm-up
steps, then N timed steps, each inside a ``comm.CommCounter``. Rank 0 prints a short summary and,
as its last line, one JSON object. Run as a plain process with a config whose world size
(tp * cp * dp * pp) is above 1, the command re-launches itself under torchrun with one process
per rank.

Communication formula (bytes one rank sends per optimizer step, ring algorithm, as
``comm.CommCounter`` counts them): see ``collectives_per_step``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatronish.config import Config, Derived, load_config, world_size_of
from megatronish.distributed import comm
from megatronish.errors import UserError
from megatronish.observe.phases import FIELDS, current_rss, peak_memory

FP32_BYTES = 4
FP64_BYTES = 8
INT64_BYTES = 8
STEP_FLAGS = 3  # faults.agree_on_step: loss non-finite, grad_norm non-finite, stop requested


# --------------------------------------------------------------------------------------------
# The analytic count


@dataclass(frozen=True)
class Collective:
    """One kind of collective a training step issues: `count` calls of `payload` bytes each on
    the `group` ("tp" or "dp") of `size` ranks. payload is what ``comm`` counts: the tensor of
    an all-reduce or broadcast, the full (gathered) tensor of an all-gather or reduce-scatter."""

    what: str
    kind: str
    group: str
    size: int
    payload: int
    count: int

    @property
    def sent(self) -> float:
        """Bytes this rank sends for all `count` calls: ring all-reduce 2 (n-1)/n x payload,
        all-gather, reduce-scatter and broadcast (n-1)/n x payload."""
        if self.kind in ("p2p", "cp_ring"):
            return self.count * self.payload
        factor = (2 if self.kind == "all_reduce" else 1) * (self.size - 1) / self.size
        return self.count * self.payload * factor


def local_parameter_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Parameters one tp rank of pipeline stage pp_rank holds (the padded vocab included): the
    elements its data-parallel gradient all-reduce (or ZeRO-1 reduce-scatter and all-gather)
    carries. The first stage holds the embeddings, the last the final norm and the output layer
    (with tied embeddings and pp > 1, a copy of the token embedding)."""
    m, t, h = cfg.model, derived.tp, cfg.model.d_model
    first, last = pp_rank == 0, pp_rank == derived.pp - 1
    gpt2 = m.arch == "gpt2"
    norm = 2 * h if gpt2 else h
    qkv_out = (m.n_head + 2 * derived.n_kv_head) * derived.head_dim // t
    attn = qkv_out * h + h * (m.n_head * derived.head_dim // t)
    attn += qkv_out + h if gpt2 else 0
    f_local = derived.d_ff // t
    mlp = (2 if gpt2 else 3) * f_local * h + (f_local + h if gpt2 else 0)
    vocab_local = derived.padded_vocab_size // t
    embed = vocab_local * h + (m.max_seq_len * h if gpt2 else 0) if first else 0
    head = vocab_local * h if last and (not derived.tie_embeddings or not first) else 0
    layers = derived.stage_layers[pp_rank]
    dense = layers * (attn + mlp + 2 * norm) + embed + (norm if last else 0) + head
    moe = stage_moe_layers(derived, pp_rank)
    return dense + moe * (local_moe_params(cfg, derived) - mlp)


def stage_moe_layers(derived: Derived, pp_rank: int) -> int:
    """MoE layers on pipeline stage pp_rank."""
    layers = {i for span in derived.stage_chunks(pp_rank) for i in span}
    return len(layers.intersection(derived.moe_layers))


def local_moe_params(cfg: Config, derived: Derived, experts_only: bool = False) -> int:
    """Parameters of one MoE MLP on one rank: the router, its num_experts / ep experts (each
    f / t wide) and the shared expert (experts_only: its experts alone)."""
    moe, h = cfg.model.moe, cfg.model.d_model
    f_local = derived.moe_d_ff // derived.tp
    experts = moe.num_experts // derived.ep * 3 * h * f_local
    if experts_only:
        return experts
    return moe.num_experts * h + experts + (3 * h * f_local if moe.shared_expert else 0)


def sequence_parallel_grad_count(cfg: Config, derived: Derived, pp_rank: int = 0) -> int:
    """Elements of the replicated parameters whose gradients the trainer sums over the tp group
    under sequence parallelism on stage pp_rank: every norm, (gpt2) the row-parallel biases,
    and the MoE routers (each tp rank routes its own tokens)."""
    h, gpt2 = cfg.model.d_model, cfg.model.arch == "gpt2"
    norm = 2 * h if gpt2 else h
    row_biases = 2 * h if gpt2 else 0
    last = pp_rank == derived.pp - 1
    routers = stage_moe_layers(derived, pp_rank) * cfg.model.moe.num_experts * h
    return derived.stage_layers[pp_rank] * (2 * norm + row_biases) + (norm if last else 0) + routers


def collectives_per_step(cfg: Config, derived: Derived, pp_rank: int = 0) -> list[Collective]:
    """Every collective one rank of pipeline stage pp_rank issues in one optimizer step, from
    the config alone.

    Legend: b micro-batch, s sequence, h hidden, L layers, A accumulation steps, t tp size,
    P local parameters (``local_parameter_count``). Under bf16 autocast the matmuls run in
    bf16 (c = 2 bytes), everything else in fp32; with fp32, c = 4. Which dtype each tensor has:

    - the embedding output is a lookup of fp32 weights: fp32 [b, s, h];
    - a row-parallel output (attention projection, MLP down) is a matmul output: c [b, s, h];
    - a column-parallel input (qkv, MLP up / gate+up, LM head) is a matmul input, so its
      sequence-parallel all-gather needs only c bytes an element, and its gradient is the
      gradient of the matmul's (bf16) input: c [b, s, h];
    - the vocab-parallel cross entropy's max [b, s] and stats [2, b, s] are fp32;
    - the grad-norm partial sum is one fp64 scalar; gradients, parameters and the loss fp32.

    Per micro-batch without sequence parallelism (tp > 1): one fp32 all-reduce after the
    embedding; per layer 2 all-reduces forward (attention projection, MLP down) and 2 backward
    (input gradients of qkv and of the MLP's first projection), each c [b, s, h]; the LM head's
    input gradient c [b, s, h] backward; the loss's two small all-reduces. With sequence
    parallelism each activation all-reduce becomes an all-gather plus a reduce-scatter of the
    same full tensor: forward all-gathers of the norm outputs before qkv, the MLP and the LM
    head, reduce-scatters of the row-parallel outputs; backward the matching reduce-scatters
    of the input gradients and all-gathers of the output gradients, the all-gather of the
    embedding's gradient, and a second all-gather of the input of qkv, of gpt2's MLP up and of
    the LM head (these recompute their gathered input instead of keeping it; llama's gate and
    up keep it). Full activation checkpointing reruns each block's forward, up to the last op
    that saves a tensor for backward (torch.utils.checkpoint stops there): the attention
    projection's collective, and the MLP down's only with dropout after it.

    Per step: the grad-norm all-reduce (fp64 scalar, tp > 1); under sequence parallelism the
    sum over tp of the replicated parameters' gradients; with dp > 1 the data-parallel
    all-reduce of every local gradient (fp32, 4 P bytes) and the loss mean (fp32 scalar); with
    optim.zero = 1 instead a reduce-scatter of the gradient buffer and an all-gather of the
    updated parameters (4 P bytes each, less the parameters outside the buffer: the sequence
    parallel replicated ones and the pipeline's tied embedding copies, which are all-reduced
    and broadcast by their owners), and the blocks' grad-norm partial sums (two fp64; the
    buckets are padded to a multiple of dp, which adds nothing when dp divides every
    bucket's size, as it does for these models at dp 2 and 4); then the step agreement
    (faults.agree_on_step: three fp32 flags, 12 bytes, over tp, then dp, then pp).

    With cp > 1, s is a rank's share seq_len / cp in all of the above, and per micro-batch and
    layer the ring attention sends ("cp_ring") its k and v, c [2, b, k/t, s, d] with k kv heads
    (only those travel), cp - 1 times forward and again backward, plus cp hops of their fp32
    gradient accumulator backward; attention recompute (selective or full) reruns the forward
    ring. The last stage's loss all-reduces its token count (one fp64) over cp per micro-batch.
    The data-parallel collectives below run over the dp x cp group.

    Per micro-batch and MoE layer (dropless; T = b s tokens, k top_k, E experts): over tp
    the combine weights' fp32 gradient [T, k] backward (the output and the routed tokens'
    gradient are the MLP's two all-reduces above) and a shared expert's two (under sequence
    parallelism instead: the weights all-gathered [T, k] fp32 and their gradient
    reduce-scattered, the tokens' experts all-gathered [T, k] int64, the E int64 counts
    all-reduced, a shared expert's gathers and reduce-scatters); over ep one
    all_to_all of the E int64 counts, and four of c [T k, h] (dispatch and return, forward and
    backward: the T k routed rows go out twice, and the rows the rank received from the others
    twice, which are T k per rank on average: exact summed over the ep group); over cp the E
    int64 counts for the balancing loss. Per
    step the expert gradient norm (fp64) over ep; expert gradients are summed (ZeRO-1:
    reduce-scattered and all-gathered, and their blocks' norm summed) over their
    expert-data-parallel group, dp x cp / ep ranks, the rest over dp x cp.

    With pp > 1 each stage counts its own L layers and parameters; the embedding's
    collectives are the first stage's, the LM head's and the loss's the last stage's. Per
    micro-batch a stage sends its fp32 hidden states [b, s, h] ([b, s/t, h] under sequence
    parallelism) forward (all but the last stage) and their gradient backward (all but the
    first), counted as sent once ("p2p"); with pp_virtual = v it does so for each of its v
    model chunks (per micro-batch 2 v - 1 sends on the first and the last stage, 2 v on the
    others); per step the first and last stage all-reduce the tied embedding's gradient, and
    the grad-norm partial sum and the loss are all-reduced over the pipeline.

    Ring bytes sent: all-reduce 2 (n-1)/n x payload; the others (n-1)/n x payload. Without
    sequence parallelism, fp32 or bf16, no recompute, at dp = 1 that totals
    2 (t-1)/t x A [(4 + c (4 L + 1)) b s h + 12 b s] + 2 (t-1)/t x (8 + 12).
    """
    m, p, tr = cfg.model, cfg.parallel, cfg.train
    t, pp, accum, cp = derived.tp, derived.pp, derived.grad_accum_steps, derived.cp
    dp = derived.dp * cp  # the data-parallel collectives run over dp x cp
    first, last = pp_rank == 0, pp_rank == pp - 1
    b, h, n_layer = tr.micro_batch_size, m.d_model, derived.stage_layers[pp_rank]
    s = tr.seq_len // cp
    c = 2 if tr.precision == "bf16" else FP32_BYTES
    act_fp32, act_c = b * s * h * FP32_BYTES, b * s * h * c
    out: list[Collective] = []

    def add(what: str, kind: str, group: str, size: int, payload: int, count: int) -> None:
        if size > 1 and count > 0:
            out.append(Collective(what, kind, group, size, payload, count))

    def tp_op(what: str, kind: str, payload: int, per_micro: int, on: bool = True) -> None:
        if on:
            add(what, kind, "tp", t, payload, per_micro * accum)

    full_recompute = tr.activation_checkpointing == "full"
    attn_runs = 2 if full_recompute else 1
    down_runs = 2 if full_recompute and m.dropout > 0 else 1
    gpt2 = m.arch == "gpt2"
    sp = p.sequence_parallel and t > 1
    tp_op("embedding output (forward)", "all_reduce", act_fp32, 1, first)
    if not sp:
        tp_op("attention projection output (forward)", "all_reduce", act_c, n_layer * attn_runs)
        tp_op("MLP down output (forward)", "all_reduce", act_c, n_layer * down_runs)
        tp_op("qkv input gradient (backward)", "all_reduce", act_c, n_layer)
        tp_op("MLP first projection input gradient (backward)", "all_reduce", act_c, n_layer)
        tp_op("LM head input gradient (backward)", "all_reduce", act_c, 1, last)
    else:
        tp_op("embedding output gradient (backward)", "all_gather", act_fp32, 1, first)
        # Forward all-gathers of norm outputs; qkv, gpt2's MLP up and the LM head gather again
        # in backward. Under full recompute the rerun block forward gathers once more.
        qkv_gathers = 2 + (1 if full_recompute else 0)
        mlp_gathers = (2 if gpt2 else 1) + (1 if full_recompute else 0)
        tp_op("qkv input (forward, backward)", "all_gather", act_c, n_layer * qkv_gathers)
        tp_op("MLP input (forward, backward)", "all_gather", act_c, n_layer * mlp_gathers)
        tp_op("LM head input (forward, backward)", "all_gather", act_c, 2, last)
        tp_op("qkv input gradient (backward)", "reduce_scatter", act_c, n_layer)
        tp_op("MLP first projection input gradient (backward)", "reduce_scatter", act_c, n_layer)
        tp_op("LM head input gradient (backward)", "reduce_scatter", act_c, 1, last)
        tp_op("attention projection output (forward)", "reduce_scatter", act_c, n_layer * attn_runs)
        tp_op("MLP down output (forward)", "reduce_scatter", act_c, n_layer * down_runs)
        tp_op("row-parallel output gradients (backward)", "all_gather", act_c, 2 * n_layer)
    tp_op("cross-entropy row max (forward)", "all_reduce", b * s * FP32_BYTES, 1, last)
    tp_op(
        "cross-entropy target logit and sum of exp (forward)", "all_reduce", 2 * b * s * 4, 1, last
    )
    moe_layers = stage_moe_layers(derived, pp_rank)
    if moe_layers:
        k, num_experts = m.moe.top_k, m.moe.num_experts
        weights = b * s * k * FP32_BYTES
        if not sp:
            tp_op("MoE combine weights gradient (backward)", "all_reduce", weights, moe_layers)
        else:  # each tp rank routes its own tokens: weights and experts are gathered
            tp_op("MoE combine weights (forward)", "all_gather", weights, moe_layers)
            tp_op("MoE combine weights gradient (backward)", "reduce_scatter", weights, moe_layers)
            tp_op("MoE experts of the tokens (forward)", "all_gather", b * s * k * INT64_BYTES,
                  moe_layers)  # fmt: skip
            tp_op("MoE routed counts for the balancing loss", "all_reduce",
                  num_experts * INT64_BYTES, moe_layers)  # fmt: skip
        if m.moe.shared_expert and not sp:
            tp_op("shared expert output (forward)", "all_reduce", act_c, moe_layers)
            tp_op("shared expert input gradient (backward)", "all_reduce", act_c, moe_layers)
        elif m.moe.shared_expert:
            tp_op("shared expert input and output gradient", "all_gather", act_c, 2 * moe_layers)
            tp_op("shared expert output and input gradient", "reduce_scatter", act_c,
                  2 * moe_layers)  # fmt: skip
        # Dropless: every token's top_k copies go out and come back, forward and backward.
        add("MoE per-expert counts (forward)", "all_to_all", "ep", derived.ep,
            num_experts * INT64_BYTES, moe_layers * accum)  # fmt: skip
        add("MoE token dispatch and return (forward, backward)", "all_to_all", "ep", derived.ep,
            b * s * k * h * c, 4 * moe_layers * accum)  # fmt: skip
        add("MoE routed counts for the balancing loss", "all_reduce", "cp", cp,
            num_experts * INT64_BYTES, moe_layers * accum)  # fmt: skip
    if cp > 1:
        kv_bytes = 2 * b * (derived.n_kv_head // t) * s * derived.head_dim
        forward_rings = 2 if tr.activation_checkpointing != "none" else 1
        add("ring attention k and v (forward, backward)", "cp_ring", "cp", cp, kv_bytes * c,
            (cp - 1) * (forward_rings + 1) * n_layer * accum)  # fmt: skip
        add("ring attention dk and dv accumulator (backward)", "cp_ring", "cp", cp,
            kv_bytes * FP32_BYTES, cp * n_layer * accum)  # fmt: skip
        if last:
            add("loss token count", "all_reduce", "cp", cp, FP64_BYTES, accum)
    add("gradient norm (fp64 partial sum)", "all_reduce", "tp", t, FP64_BYTES, 1)
    add("expert gradient norm over the ep group", "all_reduce", "ep", derived.ep, FP64_BYTES, 1)
    if p.sequence_parallel:
        sp_bytes = sequence_parallel_grad_count(cfg, derived, pp_rank) * FP32_BYTES
        add(
            "replicated-parameter gradients (sequence parallel)", "all_reduce", "tp", t, sp_bytes, 1
        )
    if pp > 1:
        hidden = b * (s // t if sp else s) * h * FP32_BYTES
        # Per model chunk: its output forward (all but the model's last chunk) and its input
        # gradient backward (all but chunk 0).
        virtual = derived.pp_virtual
        sends = (virtual - (1 if last else 0)) + (virtual - (1 if first else 0))
        add("hidden states and their gradients (point to point)", "p2p", "pp", pp, hidden,
            sends * accum)  # fmt: skip
        if derived.tie_embeddings and (first or last):
            vocab_local = derived.padded_vocab_size // t
            add("tied embedding gradient (first and last stage)", "all_reduce", "embedding", 2,
                vocab_local * h * FP32_BYTES, 1)  # fmt: skip
        add("gradient norm over the stages", "all_reduce", "pp", pp, FP64_BYTES, 1)
    local_bytes = local_parameter_count(cfg, derived, pp_rank) * FP32_BYTES
    expert_bytes = moe_layers * local_moe_params(cfg, derived, True) * FP32_BYTES
    edp = dp // derived.ep  # the ranks that hold the same experts
    if cfg.optim.zero == 1 and dp > 1:
        # Outside the gradient buffer (summed over tp or the embedding group first): whole
        # parameters, all-reduced and broadcast by their owners. The buffer's buckets are
        # reduce-scattered and their updated blocks all-gathered.
        outside = (sequence_parallel_grad_count(cfg, derived, pp_rank) if p.sequence_parallel
                   else 0) * FP32_BYTES  # fmt: skip
        if pp > 1 and derived.tie_embeddings and (first or last):
            outside += derived.padded_vocab_size // t * h * FP32_BYTES
        dense = local_bytes - expert_bytes - outside
        if outside:
            add("gradients outside the buffer: average", "all_reduce", "dp", dp, outside, 1)
            add("ZeRO-1 broadcasts of the parameters outside the buffer", "broadcast", "dp", dp,
                outside, 1)  # fmt: skip
        add("ZeRO-1 gradient reduce-scatter", "reduce_scatter", "dp", dp, dense, 1)
        add("ZeRO-1 parameter all-gather", "all_gather", "dp", dp, dense, 1)
        add("ZeRO-1 expert gradient reduce-scatter", "reduce_scatter", "dp", edp, expert_bytes,
            1)  # fmt: skip
        add("ZeRO-1 expert all-gather", "all_gather", "dp", edp, expert_bytes, 1)
        add("gradient norm of the blocks (split, replicated)", "all_reduce", "dp", dp,
            2 * FP64_BYTES, 1)  # fmt: skip
        if expert_bytes:
            add("gradient norm of the expert blocks", "all_reduce", "dp", edp, FP64_BYTES, 1)
    else:
        add("data-parallel gradient average", "all_reduce", "dp", dp, local_bytes - expert_bytes,
            1)  # fmt: skip
        add("expert gradient sum (expert-data-parallel)", "all_reduce", "dp", edp, expert_bytes,
            1)  # fmt: skip
    add("loss mean", "all_reduce", "dp", dp, FP32_BYTES, 1)
    add("loss from the last stage", "all_reduce", "pp", pp, FP32_BYTES, 1)
    for group, size in (("tp", t), ("dp", dp), ("pp", pp)):
        add("step agreement: non-finite and stop flags", "all_reduce", group, size,
            STEP_FLAGS * FP32_BYTES, 1)  # fmt: skip
    return out


def formula_bytes_per_step(cfg: Config, derived: Derived, pp_rank: int = 0) -> float:
    """Bytes one rank of stage pp_rank sends per optimizer step by the analytic count
    (``collectives_per_step``)."""
    return float(sum(op.sent for op in collectives_per_step(cfg, derived, pp_rank)))


def formula_payload_by_kind(cfg: Config, derived: Derived, pp_rank: int = 0) -> dict[str, int]:
    """Payload bytes per collective kind per step, as ``CommCounter.payload_bytes`` keys them."""
    totals: dict[str, int] = {}
    for op in collectives_per_step(cfg, derived, pp_rank):
        totals[op.kind] = totals.get(op.kind, 0) + op.payload * op.count
    return totals


# --------------------------------------------------------------------------------------------
# Timing


@dataclass
class BenchResult:
    """What `time_steps` measured on this rank. The byte and call counts are per step (the
    mean over the timed steps; every step issues the same collectives)."""

    step_times: list[float]
    bytes_sent_per_step: float
    payload_per_step: dict[str, float]
    calls_per_step: float
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float
    peak_source: str
    world_size: int
    losses: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    """This rank's mean phase times and waits per timed step (megatronish.observe.phases)."""

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        return self.flops_per_step / self.step_time_s / (self.peak_flops * self.world_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(trainer, steps: int, warmup: int) -> BenchResult:
    """Runs `warmup` untimed and then `steps` timed optimizer steps of a ``Trainer``, counting
    each timed step's collectives. Every rank calls it; the ranks line up at a barrier first."""
    device = trainer.ps.device
    for _ in range(warmup):
        trainer.train_step()
    _sync(device)
    if dist.is_initialized():
        dist.barrier()
    trainer.timer.take()  # the timed steps' phases only
    times, losses = [], []
    with comm.CommCounter() as counter:
        for _ in range(steps):
            start = time.perf_counter()
            loss = trainer.train_step().loss
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss)
    return BenchResult(
        step_times=times,
        bytes_sent_per_step=counter.total_sent / steps,
        payload_per_step={k: v / steps for k, v in counter.payload_bytes.items()},
        calls_per_step=sum(counter.calls.values()) / steps,
        tokens_per_step=trainer.setup.derived.tokens_per_step,
        flops_per_step=trainer.flops_per_step,
        peak_flops=trainer.peak,
        peak_source=trainer.peak_source,
        world_size=trainer.ps.world_size,
        losses=losses,
        phases=dict(zip(FIELDS, trainer.timer.take() or [])),
    )


def bench_overrides(steps: int, warmup: int) -> list[str]:
    """`--set` overrides that turn a training config into a benchmark run: exactly
    warmup + steps steps, no evaluation, no checkpoints written or resumed."""
    from megatronish.config import CheckpointConfig

    sets = [f"train.steps={warmup + steps}", "train.eval_every=0"]
    fields = CheckpointConfig.__dataclass_fields__
    if "save" in fields:
        sets.append("checkpoint.save=false")
    if "resume" in fields:
        sets.append("checkpoint.resume=never")
    return sets


def _format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(cfg: Config, derived: Derived, result: BenchResult, steps: int, warmup: int) -> dict:
    """The JSON record of a benchmark (the last line the command prints)."""
    formula = formula_bytes_per_step(cfg, derived)
    ring_formula = formula_payload_by_kind(cfg, derived).get("cp_ring", 0)
    return {
        "tokens_per_s": result.tokens_per_s,
        "step_time_s": result.step_time_s,
        "mfu": result.mfu,
        "tp": derived.tp,
        "dp": derived.dp,
        "pp": derived.pp,
        "cp": derived.cp,
        "world_size": derived.world_size,
        "bytes_sent_per_step": result.bytes_sent_per_step,
        "bytes_sent_per_step_formula": formula,
        "cp_ring_bytes_per_step": result.payload_per_step.get("cp_ring", 0.0),
        "cp_ring_bytes_per_step_formula": ring_formula,
        "exposed_dp_wait_s": result.phases.get("wait_dp", 0.0),
        "grad_sync_s": result.phases.get("grad_sync", 0.0),
        "overlap_grad_reduce": cfg.optim.overlap_grad_reduce,
        "comm_calls_per_step": result.calls_per_step,
        "steps": steps,
        "warmup": warmup,
        "step_time_min_s": min(result.step_times),
        "step_time_max_s": max(result.step_times),
        "tokens_per_step": derived.tokens_per_step,
        "arch": cfg.model.arch,
        "precision": cfg.train.precision,
        "peak_source": result.peak_source,
    }


def summary_lines(cfg: Config, derived: Derived, record: dict) -> list[str]:
    """The human-readable lines printed before the JSON record."""
    m, t = cfg.model, cfg.train
    sent, formula = record["bytes_sent_per_step"], record["bytes_sent_per_step_formula"]
    calls = f" in {record['comm_calls_per_step']:.0f} collectives"
    overlap = "on" if record["overlap_grad_reduce"] else "off"
    lines = [_sent_line("sent per step by rank 0", sent, formula, calls)]
    if derived.cp > 1:
        lines.append(
            _sent_line(
                "of which ring attention (k, v and their gradients)",
                record["cp_ring_bytes_per_step"],
                record["cp_ring_bytes_per_step_formula"],
            )
        )
    return [
        f"bench: {m.arch} {m.n_layer} layers, d_model {m.d_model}, {t.precision}; "
        f"tp {derived.tp} x cp {derived.cp} x dp {derived.dp} x pp {derived.pp} "
        f"(world {derived.world_size}); "
        f"micro-batch {t.micro_batch_size} x seq {t.seq_len}, {derived.grad_accum_steps} "
        "accumulation steps",
        f"step time {record['step_time_s']:.4f} s (median of {record['steps']} after "
        f"{record['warmup']} warm-up; min {record['step_time_min_s']:.4f}, max "
        f"{record['step_time_max_s']:.4f}); {record['tokens_per_s']:.0f} tokens/s; "
        f"MFU {100 * record['mfu']:.2f}% ({record['peak_source']})",
        *lines,
        f"rank 0 waits {record['exposed_dp_wait_s'] * 1e3:.2f} ms a step in data-parallel "
        f"communication (gradient reduction overlap {overlap}); gradient sync phase "
        f"{record['grad_sync_s'] * 1e3:.2f} ms",
    ]


def memory_line(record: dict) -> str:
    """Measured peak memory next to plan's estimate."""
    above = record["peak_memory_above_start_gb"]
    return (
        f"peak memory per rank (max over ranks): {record['peak_memory_gb'] * 1024:.1f} MiB, "
        f"{above * 1024:.1f} MiB above the process before the model was built; plan's "
        f"estimate {record['plan_memory_gb'] * 1024:.1f} MiB "
        f"(measured above start / plan = {above / record['plan_memory_gb']:.2f})"
    )


def _sent_line(what: str, sent: float, formula: float, calls: str = "") -> str:
    verdict = "matches" if abs(sent - formula) <= 1e-9 * max(1.0, formula) else "DIFFERS"
    return (
        f"{what}: {_format_bytes(sent)}{calls}; analytic count {_format_bytes(formula)} ({verdict})"
    )


def memory_record(cfg: Config, derived: Derived, ps, rss_before: float) -> dict:
    """Peak memory per rank, the max over the ranks (every rank calls this), next to plan's
    estimate for the same layout. On CPU the peak is the resident set size, which also holds
    the interpreter and torch's libraries: `peak_memory_above_start_gb` leaves out what the
    process held before it built the model."""
    import dataclasses

    from megatronish.commands.plan import estimate
    from megatronish.training.metrics import peak_flops

    peak, reserved = peak_memory(ps.device)
    above = peak - rss_before if ps.device.type == "cpu" else peak
    mine = torch.tensor([peak, reserved, above], dtype=torch.float64, device=ps.device)
    if ps.world_size > 1:
        comm.all_reduce(mine, None, op=dist.ReduceOp.MAX)
    sized = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=derived.vocab_size)
    )
    plan = estimate(
        sized, derived.world_size, derived.tp, peak_flops(ps.device)[0], derived.pp, derived.cp,
        sequence_parallel=cfg.parallel.sequence_parallel, zero=cfg.optim.zero,
        activation_checkpointing=cfg.train.activation_checkpointing,
    )  # fmt: skip
    return {
        "peak_memory_gb": float(mine[0]) / 2**30,
        "peak_reserved_gb": float(mine[1]) / 2**30,
        "peak_memory_above_start_gb": float(mine[2]) / 2**30,
        "plan_memory_gb": plan.total_gb,
    }


def run_bench(cfg: Config, steps: int, warmup: int) -> dict:
    """Benchmarks this process's rank of `cfg` (already carrying ``bench_overrides``); rank 0
    prints the summary and the JSON line. Returns the JSON record."""
    from megatronish.training.trainer import Trainer, setup

    s = setup(cfg)
    trainer = None
    try:
        before = current_rss()
        trainer = Trainer(s)
        result = time_steps(trainer, steps, warmup)
        record = report(cfg, s.derived, result, steps, warmup)
        record.update(memory_record(cfg, s.derived, s.ps, before))
        if s.ps.is_main:
            for line in [*summary_lines(cfg, s.derived, record), memory_line(record)]:
                print(line)
            print(json.dumps(record), flush=True)
        return record
    finally:
        if trainer is not None:
            trainer.profiler.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def bench_in_subprocess(
    config: str, steps: int, sets: list[str], env: dict[str, str] | None = None
) -> dict:
    """The JSON record of `megatronish bench --config config --steps steps --set ...` run in a
    fresh process (for scripts that compare variants side by side)."""
    import subprocess

    args = [sys.executable, "-m", "megatronish", "bench", "--config", config, "--steps", str(steps)]
    for item in sets:
        args += ["--set", item]
    environ = None if env is None else {**os.environ, **env}
    result = subprocess.run(args, capture_output=True, text=True, check=True, env=environ)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _torchrun(args: list[str]) -> int:
    """torch.distributed.run's main with args; its exit status (2 when every rank failed with a
    user error, 1 for any other failure)."""
    from torch.distributed import run as torchrun

    try:
        torchrun.main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: the ranks printed their own errors
        failures = getattr(exc, "failures", {})
        codes = [f.exitcode for f in failures.values()] if failures else [1]
        return 2 if all(code == 2 for code in codes) else 1
    return 0


def bench(config_path: str, overrides: tuple[str, ...], steps: int, warmup: int) -> int:
    """`megatronish bench`: benchmarks in this process under torchrun or when the world is 1;
    otherwise starts tp * cp * dp * pp processes through torchrun with the same arguments
    (sharing this machine's cores between them unless OMP_NUM_THREADS is set). Returns the
    exit status."""
    if steps < 1:
        raise UserError(f"--steps {steps}: must be at least 1")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: must be at least 0")
    cfg = load_config(config_path, list(overrides) + bench_overrides(steps, warmup))
    world = world_size_of(cfg)
    if "WORLD_SIZE" in os.environ or world == 1:
        run_bench(cfg, steps, warmup)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    args = ["--standalone", f"--nproc-per-node={world}", "-m", "megatronish", "bench"]
    args += ["--config", config_path, "--steps", str(steps), "--warmup", str(warmup)]
    for override in overrides:
        args += ["--set", override]
    sys.stdout.flush()
    return _torchrun(args)
