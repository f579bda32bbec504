"""Data parallelism and ZeRO: what a rank issues over its data-parallel group, the dp x cp
ranks that hold the same parameters (the experts' over their expert-data-parallel group, the
dp x cp / ep ranks that hold the same experts). P: the rank's local parameters
(``local_parameter_count``), all gradients and parameters fp32.

Per step at optim.zero = 0 (or dp x cp = 1): the all-reduce of every local gradient (4 P bytes,
the experts' over their group). With optim.zero >= 1 instead a reduce-scatter of the gradient
buffer (ZeRO-2 and 3: one after each of the A micro-batches) and an all-gather of the updated
parameters (ZeRO-3: the modules' gathers before forward and backward, ``zero3_gathers``), 4 P
bytes each, less the parameters outside the buffer (the sequence-parallel replicated ones and
the pipeline's tied embedding copies, all-reduced, and Muon's matrices, reduced to their owner:
(n-1)/n of the payload sent, half an all-reduce's; all broadcast by their owners, the experts'
over their group), and the shards' grad-norm partial sums (two fp64; one more over the experts'
group, where there are expert shards or Muon's expert matrices); the
buckets are padded to a multiple of dp, which adds nothing when dp divides every bucket's size,
as it does for these models at dp 2 and 4. Then the loss mean (one fp32).

With optim.grad_reduce_dtype bf16 every gradient reduction over the data-parallel and expert
groups (the all-reduces at ZeRO-0, the reduce-scatters, the all-reduce and reduce of the
gradients outside the buffer) sends 2 bytes an element instead of 4; the parameter gathers and
broadcasts, the norms and the loss mean are unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from megatronish.accounting.collectives.step import (
    FP32_BYTES,
    FP64_BYTES,
    GRAD_REDUCE_BYTES,
    Collective,
    Kind,
    Purpose,
    Step,
    loss_bytes,
)
from megatronish.accounting.components.embedding import position_params
from megatronish.accounting.components.moe import local_parameters
from megatronish.accounting.components.norm import weights as norm_weights
from megatronish.accounting.lora import (
    adapter_counts,
    expert_adapter_counts,
    last_block_buffered,
)
from megatronish.accounting.muon import whole_under_zero
from megatronish.accounting.parameters import (
    local_parameter_count,
    tp_summed_grad_count,
)

GRAD, PARAMS = Purpose.GRADIENT_REDUCTION, Purpose.PARAMETERS


def dp_collectives(step: Step) -> list[Collective]:
    """The gradient reductions and parameter gathers of optim.zero, and the loss mean."""
    dp = step.dp_cp
    if step.cfg.optim.zero >= 1 and dp > 1:
        ops = _zero(step)
    else:
        experts, edp = _expert_bytes(step), _edp(step)
        dense = _trained_bytes(step) - experts
        ops = [
            _dp("data-parallel gradient average", "all_reduce", dp, _wire(step, dense), 1, GRAD),
            _dp(
                "expert gradient sum (expert-data-parallel)",
                "all_reduce",
                edp,
                _wire(step, experts),
                1,
                GRAD,
            ),
        ]
    return ops + [_dp("loss mean", "all_reduce", dp, loss_bytes(step), 1, Purpose.LOSS)]


def _dp(what: str, kind: Kind, size: int, payload: int, count: int, purpose: Purpose) -> Collective:
    """A Collective over the data-parallel group (size dp x cp) or the experts' (size
    ``_edp``)."""
    return Collective(what, kind, "dp", size, payload, count, purpose)


def _wire(step: Step, fp32_bytes: int) -> int:
    """The bytes a gradient reduction of fp32_bytes of fp32 gradients sends
    (optim.grad_reduce_dtype)."""
    return fp32_bytes // FP32_BYTES * GRAD_REDUCE_BYTES[step.cfg.optim.grad_reduce_dtype]


def _edp(step: Step) -> int:
    """The expert-data-parallel group: the ranks that hold the same experts."""
    return step.dp_cp // step.derived.ep


def _trained_bytes(step: Step) -> int:
    """The stage's parameters on this rank that train, fp32: under model.lora its adapters
    alone (accounting.lora: the frozen base sends nothing), else all."""
    if step.cfg.model.lora is not None:
        return adapter_counts(step.cfg, step.derived, step.pp_rank)[0] * FP32_BYTES
    return local_parameter_count(step.cfg, step.derived, step.pp_rank) * FP32_BYTES


def _expert_bytes(step: Step) -> int:
    """The stage's trained expert parameters on this rank, fp32 (under model.lora the experts'
    adapters)."""
    if step.cfg.model.lora is not None:
        return expert_adapter_counts(step.cfg, step.derived, step.pp_rank)[0] * FP32_BYTES
    return step.moe_layers * local_parameters(step.cfg, step.derived, True) * FP32_BYTES


def _bucketed_expert_bytes(step: Step) -> int:
    """The stage's expert parameters in ZeRO's expert buffer, fp32 (not Muon's, kept whole,
    nor the experts' adapters summed over tp first)."""
    cfg, derived, pp_rank = step.cfg, step.derived, step.pp_rank
    whole = (
        whole_under_zero(cfg, derived, pp_rank)[1] + expert_adapter_counts(cfg, derived, pp_rank)[1]
    )
    return _expert_bytes(step) - whole * FP32_BYTES


def _outside_bytes(step: Step) -> int:
    """The parameters outside ZeRO's gradient buffer (summed over tp or the embedding group
    first, and Muon's dense matrices), fp32: whole parameters, all-reduced and broadcast by their
    owners."""
    derived = step.derived
    if step.cfg.model.lora is not None:  # the dense adapters summed over tp first
        summed = adapter_counts(step.cfg, derived, step.pp_rank)[1]
        return (summed - expert_adapter_counts(step.cfg, derived, step.pp_rank)[1]) * FP32_BYTES
    outside = tp_summed_grad_count(step.cfg, derived, step.pp_rank) * FP32_BYTES
    outside += whole_under_zero(step.cfg, derived, step.pp_rank)[0] * FP32_BYTES
    if derived.pp > 1 and derived.last_stage_embedding and (step.first or step.last):
        outside += derived.padded_vocab_size // step.tp * step.h * FP32_BYTES
    return outside


def _muon_dense_bytes(step: Step) -> int:
    """Muon's dense matrices on this rank under ZeRO, fp32 (none under model.lora): outside the
    buffer, their gradients reduced to their owner alone."""
    if step.cfg.model.lora is not None:
        return 0
    return whole_under_zero(step.cfg, step.derived, step.pp_rank)[0] * FP32_BYTES


def _zero(step: Step) -> list[Collective]:
    """optim.zero >= 1 at dp x cp > 1: the buffer's buckets reduce-scattered (ZeRO-2 and 3:
    after every micro-batch) and their updated shards all-gathered (ZeRO-3: by each module,
    ``zero3_gathers``); the parameters outside it all-reduced and broadcast; the shards' norms."""
    zero, dp, edp = step.cfg.optim.zero, step.dp_cp, _edp(step)
    experts, outside = _bucketed_expert_bytes(step), _outside_bytes(step)
    whole_experts = _expert_bytes(step) - experts
    dense = _trained_bytes(step) - _expert_bytes(step) - outside
    ops = []
    broadcast = f"ZeRO-{zero} broadcasts of the parameters outside the buffer"
    muon = _muon_dense_bytes(step)
    for size, whole, owned, whose in (
        (dp, outside, muon, ""),
        (edp, whole_experts, whole_experts, "expert "),
    ):
        if whole - owned:
            what = f"{whose}gradients outside the buffer: average"
            ops.append(_dp(what, "all_reduce", size, _wire(step, whole - owned), 1, GRAD))
        if owned:
            what = f"{whose}Muon matrices' gradients: average to their owner"
            ops.append(_dp(what, "reduce", size, _wire(step, owned), 1, GRAD))
        if whole:
            ops.append(
                _dp(f"{broadcast} ({whose or 'dense'})", "broadcast", size, whole, 1, PARAMS)
            )
    passes = step.accum if zero >= 2 else 1  # reductions per step
    scatter = f"ZeRO-{zero} gradient reduce-scatter"
    expert_scatter = f"ZeRO-{zero} expert gradient reduce-scatter"
    ops += [
        _dp(scatter, "reduce_scatter", dp, _wire(step, dense), passes, GRAD),
        _dp(expert_scatter, "reduce_scatter", edp, _wire(step, experts), passes, GRAD),
    ]
    if zero < 3:
        ops += [
            _dp(f"ZeRO-{zero} parameter all-gather", "all_gather", dp, dense, 1, PARAMS),
            _dp(f"ZeRO-{zero} expert all-gather", "all_gather", edp, experts, 1, PARAMS),
        ]
    else:
        ops += zero3_gathers(step, dense)
    what, norm = "gradient norm of the shards (split, replicated)", Purpose.GRADIENT_NORM
    ops.append(_dp(what, "all_reduce", dp, 2 * FP64_BYTES, 1, norm))
    if experts or whole_experts:
        what = "gradient norm of the expert shards"
        ops.append(_dp(what, "all_reduce", edp, FP64_BYTES, 1, norm))
    return ops


def _mtp_bytes(step: Step) -> int:
    """The multi-token prediction modules' parameters in ZeRO's dense buffer on this rank, fp32:
    what they add to the stage's local parameters less what they add to those outside the buffer
    and their MoE blocks' experts (in the expert buffer)."""
    cfg, derived, last = step.cfg, step.derived, step.pp_rank
    if not step.mtp:
        return 0
    plain = replace(cfg, model=replace(cfg.model, mtp_depth=0))
    main = tuple(i for i in derived.moe_layers if i < cfg.model.n_layer)  # no MTP MoE blocks
    bare = replace(derived, moe_layers=main)
    local = local_parameter_count(cfg, derived, last) - local_parameter_count(plain, bare, last)
    outside = tp_summed_grad_count(cfg, derived, last) - tp_summed_grad_count(plain, bare, last)
    outside += whole_under_zero(cfg, derived, last)[0] - whole_under_zero(plain, bare, last)[0]
    experts = (len(derived.moe_layers) - len(main)) * local_parameters(cfg, derived, True)
    return (local - outside - experts) * FP32_BYTES


def zero3_gathers(step: Step, dense: int) -> list[Collective]:
    """ZeRO-3's parameter all-gathers of one step; `dense`: the bytes
    of the buffer's dense buckets. At pp = 1 every micro-batch gathers each bucket before its
    module's forward, the tied embedding's (with multi-token prediction the embedding's) again
    for the output layer, and each bucket again before its backward but the last module's (the
    final norm, the output layer and the multi-token prediction modules; under model.lora the
    last block with adapters in the buffers, whose experts' too) and the tied embedding's, which
    stay from their forward, and the embeddings', whose backward reads no weight; at pp > 1
    each bucket once a step (kept to its end)."""
    derived, dp, accum = step.derived, step.dp_cp, step.accum
    experts, edp = _bucketed_expert_bytes(step), _edp(step)
    if derived.pp > 1:
        return [
            _dp(
                "ZeRO-3 parameter all-gather (kept for the step)",
                "all_gather",
                dp,
                dense,
                1,
                PARAMS,
            ),
            _dp(
                "ZeRO-3 expert all-gather (kept for the step)",
                "all_gather",
                edp,
                experts,
                1,
                PARAMS,
            ),
        ]
    backward, again, kept_experts = _zero3_backward(step, dense)
    ag = "all_gather"
    return [
        _dp("ZeRO-3 parameter all-gather (forward)", ag, dp, dense, accum, PARAMS),
        _dp("ZeRO-3 embedding all-gather again (output layer, MTP)", ag, dp, again, accum, PARAMS),
        _dp("ZeRO-3 parameter all-gather (backward)", ag, dp, backward, accum, PARAMS),
        _dp("ZeRO-3 expert all-gather (forward)", ag, edp, experts, accum, PARAMS),
        _dp("ZeRO-3 expert all-gather (backward)", ag, edp, experts - kept_experts, accum, PARAMS),
    ]


def _zero3_backward(step: Step, dense: int) -> tuple[int, int, int]:
    """(the dense buckets' bytes gathered for a micro-batch's backward, the embedding's gathered
    again in its forward, the expert buckets' bytes kept from its forward to its backward) at
    pp = 1 (zero3_gathers). Under model.lora the buffers hold the adapters alone: the last
    block with some keeps its own, and nothing is gathered again."""
    if step.cfg.model.lora is not None:
        kept, kept_experts = last_block_buffered(step.cfg, step.derived, step.pp_rank)
        return dense - kept * FP32_BYTES, 0, kept_experts * FP32_BYTES
    model, derived = step.cfg.model, step.derived
    norm = norm_weights(model) * FP32_BYTES
    vocab = derived.padded_vocab_size // step.tp * step.h * FP32_BYTES
    tied = vocab if derived.tie_embeddings else 0
    kept = (0 if step.sp else norm) + (0 if derived.tie_embeddings else vocab) + _mtp_bytes(step)
    positions = position_params(model) * FP32_BYTES
    lookups = (0 if derived.tie_embeddings else vocab) + positions  # not gathered for backward
    again = vocab if derived.last_stage_embedding else 0  # the output layer's, MTP's lookups
    return dense - kept - tied - lookups, again, 0
