"""The collectives one rank issues per optimizer step, from the config alone
(``collectives_per_step``: the formula, with its legend), and the bytes they send: what
``comm.CommCounter`` counts on the wire and the tests hold it to."""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.accounting.parameters import (
    local_moe_params,
    local_parameter_count,
    sequence_parallel_grad_count,
    stage_moe_layers,
)
from megatronish.config import Config, Derived

FP32_BYTES = 4
FP64_BYTES = 8
INT64_BYTES = 8
STEP_FLAGS = 4  # faults.agree_on_step: loss and grad_norm non-finite, stop, writer busy


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


def collectives_per_step(
    cfg: Config, derived: Derived, pp_rank: int = 0, loss_masked: bool | None = None
) -> list[Collective]:
    """Every collective one rank of pipeline stage pp_rank issues in one optimizer step, from
    the config alone, and loss_masked: whether the run's loader masks the loss (SFT data; None:
    data.eod_mask_loss).

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
    optim.zero >= 1 instead a reduce-scatter of the gradient buffer (ZeRO-2 and 3: A of them,
    one after each micro-batch) and an all-gather of the updated parameters (ZeRO-3: the
    modules' gathers before forward and backward, ``zero3_gathers``), 4 P bytes each, less the
    parameters outside the buffer (the sequence parallel replicated ones and the pipeline's
    tied embedding copies, which are all-reduced and broadcast by their owners), and the
    blocks' grad-norm partial sums (two fp64; the
    buckets are padded to a multiple of dp, which adds nothing when dp divides every
    bucket's size, as it does for these models at dp 2 and 4); then the step agreement
    (faults.agree_on_step: four fp32 flags, 16 bytes, over tp, then dp, then pp).

    With cp > 1, s is a rank's share seq_len / cp in all of the above, and per micro-batch and
    layer the ring attention sends ("cp_ring") its k and v, c [2, b, k/t, s, d] with k kv heads
    (only those travel), cp - 1 times forward and again backward, plus cp hops of their fp32
    gradient accumulator backward; attention recompute (selective or full) reruns the forward
    ring. The last stage's loss all-reduces its token count (one fp64) over cp per micro-batch.
    The data-parallel collectives below run over the dp x cp group. With a loss mask the last
    stage instead all-reduces the counted tokens of the global batch (one fp64) over dp x cp
    once per step (training/loss.py).

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
    masked = cfg.data.eod_mask_loss if loss_masked is None else loss_masked
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
        if last and not masked:
            add("loss token count", "all_reduce", "cp", cp, FP64_BYTES, accum)
    if last and masked:
        add("counted tokens of the global batch (loss mask)", "all_reduce", "dp", dp, FP64_BYTES,
            1)  # fmt: skip
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
    zero = cfg.optim.zero
    if zero >= 1 and dp > 1:
        # Outside the gradient buffer (summed over tp or the embedding group first): whole
        # parameters, all-reduced and broadcast by their owners. The buffer's buckets are
        # reduce-scattered (ZeRO-2 and 3: after every micro-batch) and their updated blocks
        # all-gathered (ZeRO-3: by each module, zero3_gathers).
        outside = (sequence_parallel_grad_count(cfg, derived, pp_rank) if p.sequence_parallel
                   else 0) * FP32_BYTES  # fmt: skip
        if pp > 1 and derived.tie_embeddings and (first or last):
            outside += derived.padded_vocab_size // t * h * FP32_BYTES
        dense = local_bytes - expert_bytes - outside
        if outside:
            add("gradients outside the buffer: average", "all_reduce", "dp", dp, outside, 1)
            add(f"ZeRO-{zero} broadcasts of the parameters outside the buffer", "broadcast",
                "dp", dp, outside, 1)  # fmt: skip
        reductions = accum if zero >= 2 else 1
        add(f"ZeRO-{zero} gradient reduce-scatter", "reduce_scatter", "dp", dp, dense,
            reductions)  # fmt: skip
        add(f"ZeRO-{zero} expert gradient reduce-scatter", "reduce_scatter", "dp", edp,
            expert_bytes, reductions)  # fmt: skip
        if zero < 3:
            add(f"ZeRO-{zero} parameter all-gather", "all_gather", "dp", dp, dense, 1)
            add(f"ZeRO-{zero} expert all-gather", "all_gather", "dp", edp, expert_bytes, 1)
        else:
            for what, group, size, payload, count in zero3_gathers(cfg, derived, pp_rank, dense):
                add(what, "all_gather", group, size, payload, count)
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


def zero3_gathers(cfg: Config, derived: Derived, pp_rank: int, dense: int) -> list[tuple]:
    """ZeRO-3's parameter all-gathers of one step on stage pp_rank, as (what, group, group
    size, payload, count); `dense`: the bytes of the buffer's dense buckets. At pp = 1 every
    micro-batch gathers each bucket before its module's forward, the tied embedding's again
    for the output layer, and each bucket again before its backward but the last module's (the
    final norm and the output layer) and the tied embedding's, which stay from their forward,
    and the embeddings', whose backward reads no weight; at pp > 1 each bucket once a step
    (kept to its end)."""
    t, h, pp, accum = derived.tp, cfg.model.d_model, derived.pp, derived.grad_accum_steps
    dp = derived.dp * derived.cp
    moe_layers = stage_moe_layers(derived, pp_rank)
    experts = moe_layers * local_moe_params(cfg, derived, True) * FP32_BYTES
    edp = dp // derived.ep
    if pp > 1:
        return [
            ("ZeRO-3 parameter all-gather (kept for the step)", "dp", dp, dense, 1),
            ("ZeRO-3 expert all-gather (kept for the step)", "dp", edp, experts, 1),
        ]
    sp = cfg.parallel.sequence_parallel and t > 1
    norm = (2 if cfg.model.arch == "gpt2" else 1) * h * FP32_BYTES
    vocab = derived.padded_vocab_size // t * h * FP32_BYTES
    tied = vocab if derived.tie_embeddings else 0
    kept = (0 if sp else norm) + (0 if derived.tie_embeddings else vocab)
    positions = cfg.model.max_seq_len * h * FP32_BYTES if cfg.model.arch == "gpt2" else 0
    lookups = (0 if derived.tie_embeddings else vocab) + positions  # not gathered for backward
    return [
        ("ZeRO-3 parameter all-gather (forward)", "dp", dp, dense, accum),
        ("ZeRO-3 tied embedding all-gather (output layer)", "dp", dp, tied, accum),
        (
            "ZeRO-3 parameter all-gather (backward)",
            "dp",
            dp,
            dense - kept - tied - lookups,
            accum,
        ),  # fmt: skip
        ("ZeRO-3 expert all-gather (forward, backward)", "dp", edp, experts, 2 * accum),
    ]


def formula_bytes_per_step(
    cfg: Config, derived: Derived, pp_rank: int = 0, loss_masked: bool | None = None
) -> float:
    """Bytes one rank of stage pp_rank sends per optimizer step by the analytic count
    (``collectives_per_step``)."""
    ops = collectives_per_step(cfg, derived, pp_rank, loss_masked)
    return float(sum(op.sent for op in ops))


def formula_payload_by_kind(
    cfg: Config, derived: Derived, pp_rank: int = 0, loss_masked: bool | None = None
) -> dict[str, int]:
    """Payload bytes per collective kind per step, as ``CommCounter.payload_bytes`` keys them."""
    totals: dict[str, int] = {}
    for op in collectives_per_step(cfg, derived, pp_rank, loss_masked):
        totals[op.kind] = totals.get(op.kind, 0) + op.payload * op.count
    return totals
