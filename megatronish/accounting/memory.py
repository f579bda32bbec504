"""Per-rank memory of a layout (``estimate``, with the traffic plan prints beside it), from
formulas without starting anything.

Memory per rank (bytes), P the parameters one tp rank holds, D = dp x cp (expert weights: the
dp x cp / ep ranks that hold the same experts):
  weights 4P, gradients 4P, AdamW state 8P (optim.name muon: 4 bytes for each element of a
  Muon matrix, its momentum, accounting.muon), the bf16 copies autocast makes of the weights 2P
  (bf16; with train.precision fp8 and bf16 around it, 2 bytes for each weight outside the fp8
  layers only: fp8 quantizes the fp32 weights of the blocks' attention projections, dense
  MLPs, shared and routed experts, model.precision.fp8_layers and fp8_moe_layers, and saves
  them as they are; it keeps each such weight's two fp8 casts, for the forward and for the
  input gradient, for the whole step: 2 bytes a weight, at any optim.zero; under model.lora
  not the input gradient's of the first block's layers whose input needs no gradient,
  accounting.lora.frozen_inputs; the frozen linear weights a LoRA run holds in bf16 alone 2
  bytes, no fp32 master nor copy: accounting.lora.bf16_held_weights); the DeepSeek
  router's routing bias, experts x fp32 per MoE layer, a buffer without gradient or AdamW state
  ("buffers"); optim.zero = 1 divides the AdamW state by D, 2 the gradients too, 3 the weights
  too (``model_state_bytes``; ZeRO-2 and 3 keep the parameters outside the gradient buffer,
  the sequence-parallel replicated ones, the pipeline's tied embedding copy and Muon's
  matrices, whole; a Muon matrix's momentum lives on the one rank that owns it). What
  a step holds only while it runs ("gathered"): at ZeRO-2 and 3 the bucket-sized gradients of
  up to IN_FLIGHT + 1 buckets whose reduce-scatter has not finished (with
  optim.grad_reduce_dtype bf16 their bf16 copies and the fp32 bucket being filled; ZeRO-0 and 1
  then hold up to IN_FLIGHT + 1 bf16 copies too); ZeRO-3 at pp = 1 two layers'
  parameters (the one that runs, the one prefetched) and the output layer's (kept from its
  forward to its backward, with multi-token prediction with its modules' and, untied, the token
  embedding's they read), at pp > 1 the stage's whole parameters (kept for the step);
  activations per layer and micro-batch (Korthikanti et al. 2022, 16-bit activations, s seq,
  b micro-batch, h hidden, t tp), with a fused attention kernel (no s x s scores kept):
    tensor parallel        s b h (10 + 24 / t): the norms 4, attention 3 + 8 / t, the MLP
                           3 + 16 / t (each component's ``activations``,
                           accounting.components)
    + sequence parallel    s b h (34 / t)
    full recompute         2 s b h (/ t with sequence parallel) kept per layer, plus one layer's
                           working set during its backward
  (multi-head latent attention: its heads' q, k, v and output over the query-key and value head
  dims, and its latents; each attention kind's ``activations`` in accounting.components; a
  Gated DeltaNet block instead of attention's heads what its code saves, counted tensor by
  tensor, selective recompute keeping only the inputs of its convolution and delta rule:
  accounting.components.gated_deltanet.kept_bytes, and its input whole under sequence
  parallelism too: its four projections keep what they gather),
  times 2 for fp32 activations; plus the logits and the loss's softmax, b s V / t x 6 bytes
  (bf16 logits, fp32 softmax). Llama's SwiGLU MLP and GQA move these by a few percent.
  Multi-token prediction (model.mtp_depth D) adds D layers and D logits to the last stage.
  With train.precision fp8 the activations are those of its fp8_high_precision (16-bit for
  bf16): every recipe (tensorwise, rowwise, blockwise) saves an fp8 GEMM's input for backward
  as it arrives, in that precision, and quantizes it again there (megatronish.fp8.gemm), so an
  fp8 layer keeps what a bf16 one keeps, less autocast's weight copies.

With pipeline parallelism (pp stages, m micro-batches per step) each stage holds its own
layers' parameters (the embeddings on the first stage, the output layer on the last) and the
activations of the micro-batches in flight: under 1F1B stage r holds min(pp - r, m) of them,
under GPipe all m (the last stage then also keeps m micro-batches of logits). A layout's
memory is that of its fullest stage. The schedule's bubble (``Estimate.bubble``) stretches the
step by (pp - 1) / m.
Interleaved (parallel.pp_virtual = v, kept at every pp > 1 whose m is a multiple of pp and
that leaves a layer for each of the pp v chunks, else 1): the bubble is (pp - 1) / (v m), and
under 1F1B stage r holds min(2 (pp - r - 1) + (v - 1) pp + 1, m v) (micro-batch, chunk) pairs
(Megatron's warm-up; all m v when m = pp, and the last stage then keeps m micro-batches of
logits), each of its L_r / v layers on average: the first stage (1 + (pp - 1) / (pp v)) times
the micro-batches of layers of plain 1F1B.

With context parallelism (cp ranks split every sequence) a rank keeps the activations and
logits of s / cp tokens: the formulas above with s / cp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

from megatronish.accounting.collectives import formula_bytes_per_step
from megatronish.accounting.components import (
    ATTENTION,
    attention_of,
    gated_deltanet,
    mlp,
    norm,
)
from megatronish.accounting.memo import per_config
from megatronish.accounting.model_state import model_state_bytes
from megatronish.accounting.parameters import (
    mtp_blocks,
    stage_blocks,
    stage_moe_layers,
)
from megatronish.config import Config, Derived, derive, virtual_stages
from megatronish.pipeline.schedule import warmup_forwards

GB = 1024**3


@dataclass
class Estimate:
    """One layout's per-rank figures."""

    tp: int
    dp: int
    pp: int
    bubble: float
    sequence_parallel: bool
    zero: int
    activation_checkpointing: str
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    logits_gb: float
    comm_gb_per_step: float
    cp: int = 1
    pp_virtual: int = 1
    """Model chunks per pipeline stage (interleaved schedule when > 1)."""
    ep: int = 1
    """Expert-parallel degree (MoE): experts per rank num_experts / ep."""
    expert_gb: float = 0.0
    """Of weights + grads + optimizer state, the experts' (MoE)."""
    buffers_gb: float = 0.0
    """Model state without gradient or optimizer state: the sigmoid router's routing biases."""
    gathered_gb: float = 0.0
    """What a step holds beyond the kept state: gradient buckets in flight (ZeRO-2 and 3, and
    any level's bf16 copies with optim.grad_reduce_dtype bf16), ZeRO-3's gathered parameters."""

    @property
    def total_gb(self) -> float:
        return (
            self.weights_gb
            + self.grads_gb
            + self.optimizer_gb
            + self.buffers_gb
            + self.gathered_gb
            + self.activations_gb
            + self.logits_gb
        )


def activation_bytes_per_layer(
    cfg: Config, tp: int, sequence_parallel: bool, recompute: str, index: int = 0
) -> float:
    """Bytes transformer block `index` (its attention of its own kind) keeps for backward for
    one micro-batch (see module doc); s is a rank's share of the sequence, seq_len /
    parallel.cp."""
    kind = cfg.model.block_attention(index)
    return _kind_activation_bytes(cfg, None, tp, sequence_parallel, recompute, kind)


@per_config
def _kind_activation_bytes(
    cfg: Config, derived: None, tp: int, sequence_parallel: bool, recompute: str, kind: str
) -> float:
    """``activation_bytes_per_layer`` of a block whose attention is of `kind` (the only way
    its index counts)."""
    s, b, h = cfg.train.seq_len // cfg.parallel.cp, cfg.train.micro_batch_size, cfg.model.d_model
    sbh = s * b * h
    width = 1.0 if cfg.train.bf16_autocast else 2.0  # the formula counts 16-bit values
    if recompute == "full":
        kept = 2 * sbh / (tp if sequence_parallel else 1)
        return kept * width
    model = cfg.model
    attention, heads, replicated, latents = ATTENTION[kind].activations(model)
    mixer = 0  # Gated DeltaNet's own count, in bytes
    if kind == "gated_deltanet":
        selective, cp, bytes_16 = recompute == "selective", cfg.parallel.cp, int(2 * width)
        mixer = gated_deltanet.kept_bytes(model, tp, cp, b, s, bytes_16, selective)
    mlp_whole, mlp_split = mlp.activations(model)
    whole = norm.activations(model) + attention + mlp_whole  # 10 s b h, whole on every tp rank
    if sequence_parallel:
        per = (whole + mlp_split + heads + replicated) / tp
    else:
        per = whole + (mlp_split + heads) / tp
        per += replicated
    return sbh * (per + latents) * width + mixer


def decode_cache_elements(cfg: Config, derived: Derived) -> tuple[int, int]:
    """Elements one tp rank's decode cache (generate) holds per token and layer: (what it
    holds, the keys and values of its heads). They differ under multi-head latent attention,
    which caches the normed latent and the shared rotary key, kv_lora_rank + qk_rope_head_dim
    (whole on every tp rank), and rebuilds the keys and values from them."""
    return attention_of(cfg.model).cache_elements(cfg.model, derived)


def estimate(
    cfg: Config, world: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1, **changes
) -> Estimate:
    """Per-rank memory (of the fullest pipeline stage) and traffic of cfg at tensor-parallel
    degree tp, context-parallel degree cp, pipeline degree pp and (MoE) expert-parallel degree
    ep on world devices; `changes` override parallel.sequence_parallel, optim.zero,
    activation_checkpointing."""
    layout, derived = layout_config(cfg, world, tp, pp, cp, ep, **changes)
    sp, zero = layout.parallel.sequence_parallel, layout.optim.zero
    recompute, virtual = layout.train.activation_checkpointing, derived.pp_virtual
    m, train = derived.grad_accum_steps, cfg.train
    # The last stage keeps every micro-batch's logits when it runs all its forwards first.
    gpipe = layout.parallel.pp_schedule == "gpipe"
    all_forwards_first = pp > 1 and (gpipe or (virtual > 1 and m == pp))
    kept = partial(activation_bytes_per_layer, layout, tp, sp)
    logits_one = train.micro_batch_size * train.seq_len // cp * derived.padded_vocab_size / tp * 6
    bubble = (pp - 1) / (virtual * m)
    comm = max(formula_bytes_per_step(layout, derived, r) for r in distinct_stages(derived)) / GB
    stages = []
    for r in range(pp):
        in_flight = _in_flight(pp, virtual, m, r, layout.parallel.pp_schedule)
        state = model_state_bytes(layout, derived, r)
        blocks = stage_blocks(derived, r) + mtp_blocks(layout, derived, r)
        act = sum(kept(recompute, i) for i in blocks) * in_flight
        if recompute == "full":  # one layer is rebuilt at a time during backward
            act += max(kept("none", i) for i in blocks)
        logits = logits_one * (m if all_forwards_first else 1) if r == pp - 1 else 0.0
        logits *= 1 + layout.model.mtp_depth  # each multi-token prediction module's too
        stages.append(
            Estimate(
                tp=tp,
                dp=derived.dp,
                pp=pp,
                bubble=bubble,
                sequence_parallel=sp,
                zero=zero,
                activation_checkpointing=recompute,
                weights_gb=state["weights"] / GB,
                grads_gb=state["grads"] / GB,
                optimizer_gb=state["optimizer"] / GB,
                activations_gb=act / GB,
                logits_gb=logits / GB,
                comm_gb_per_step=comm,
                cp=cp,
                pp_virtual=virtual,
                ep=derived.ep,
                expert_gb=state["experts"] / GB,
                buffers_gb=state["buffers"] / GB,
                gathered_gb=state["gathered"] / GB,
            )
        )
    return max(stages, key=lambda e: e.total_gb)


def distinct_stages(derived: Derived) -> list[int]:
    """One pipeline rank of each kind of stage: a stage's collectives follow from whether it is
    the first and the last, and its layers and MoE layers alone (accounting.collectives)."""
    kinds = {}
    for r in range(derived.pp):
        kind = (r == 0, r == derived.pp - 1, derived.stage_layers[r], stage_moe_layers(derived, r))
        kinds.setdefault(kind, r)
    return list(kinds.values())


def layout_config(
    cfg: Config, world: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1, **changes
) -> tuple[Config, Derived]:
    """cfg at tensor-parallel degree tp, pipeline degree pp, context-parallel degree cp and
    expert-parallel degree ep on world devices (dp the rest), and its derived sizes: what
    ``estimate`` and the step-time model read. `changes` override parallel.sequence_parallel
    (default: on at tp > 1 without experts), optim.zero and train.activation_checkpointing;
    parallel.pp_virtual is kept where it fits (else 1)."""
    moe = cfg.model.moe.num_experts > 0
    # Sequence parallelism is not supported with experts at tp > 1.
    sp = changes.get("sequence_parallel", tp > 1 and not moe)
    zero = changes.get("zero", cfg.optim.zero)
    recompute = changes.get("activation_checkpointing", cfg.train.activation_checkpointing)
    dp = world // (tp * cp * pp)
    virtual = _virtual(cfg, pp, dp)
    same_split = pp == cfg.parallel.pp and virtual == virtual_stages(cfg)
    layers = cfg.parallel.pp_layers if same_split else None
    parallel = dataclasses.replace(
        cfg.parallel, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, sequence_parallel=sp
    )
    layout = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(parallel, pp_virtual=virtual, pp_layers=layers),
        optim=dataclasses.replace(cfg.optim, zero=zero),
        train=dataclasses.replace(cfg.train, activation_checkpointing=recompute),
    )
    return layout, derive(layout, world, vocab_size=cfg.model.vocab_size)


def _virtual(cfg: Config, pp: int, dp: int) -> int:
    """parallel.pp_virtual at pipeline degree pp and data-parallel degree dp, where it fits (m a
    multiple of pp, a layer for each chunk), else 1."""
    virtual = cfg.parallel.pp_virtual if pp > 1 else 1
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    if virtual > 1 and (m % pp or cfg.model.n_layer < pp * virtual):
        return 1
    return virtual


def _in_flight(pp: int, virtual: int, m: int, pp_rank: int, schedule: str) -> float:
    """The most micro-batches of a stage's layers whose activations it holds at once (a
    fraction under interleaving: (micro-batch, chunk) pairs / v)."""
    if pp > 1 and schedule == "gpipe":
        return m
    if virtual == 1:
        return min(pp - pp_rank, m)
    pairs = min(warmup_forwards(pp, virtual, m, pp_rank) + 1, m * virtual)
    return pairs / virtual
