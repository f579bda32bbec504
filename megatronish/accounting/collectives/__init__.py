"""The collectives one rank issues per optimizer step, from the config alone
(``collectives_per_step``), and the bytes they send: what ``comm.CommCounter`` counts on the
wire and the tests hold it to. One module a dimension says what it issues and when: tp (tensor
parallelism, sequence parallelism, the vocab-parallel loss, MoE routing), cp (the ring, the
loss's token counts), fp8 (the scales' amax all-reduces over tp, cp or tp x cp), ep (MoE
all-to-all), pp (point-to-point sends, the tied embedding), dp (data parallelism at each ZeRO
level); step holds what they share and the step agreement.

Legend: b micro-batch, s sequence (a rank's share seq_len / cp), h hidden, L layers of the
stage, A accumulation steps, t tp size, P local parameters (``local_parameter_count``). With
pp > 1 each stage counts its own L layers and parameters; the embedding's collectives are the
first stage's, the LM head's and the loss's the last stage's. Under bf16 autocast the matmuls
run in bf16 (c = 2 bytes, ``Step.operand_bytes``), everything else in fp32; with fp32, c = 4.
Which dtype each tensor has:

- the embedding output is a lookup of fp32 weights: fp32 [b, s, h];
- a row-parallel output (attention projection, MLP down) is a matmul output: c [b, s, h];
- a column-parallel input (qkv, MLP up / gate+up, LM head) is a matmul input, so its
  sequence-parallel all-gather needs only c bytes an element, and its gradient is the
  gradient of the matmul's (bf16) input: c [b, s, h];
- the vocab-parallel cross entropy's max [b, s] and stats [2, b, s] are fp32;
- the grad-norm partial sum is one fp64 scalar; gradients, parameters and the loss fp32.

Ring bytes sent (``Collective.sent``): all-reduce 2 (n-1)/n x payload; the others (n-1)/n x
payload. Without sequence parallelism, fp32 or bf16, no recompute, at dp = 1 that totals
2 (t-1)/t x A [(4 + c (4 L + 1)) b s h + 12 b s] + 2 (t-1)/t x (8 + 12).
"""

from __future__ import annotations

from megatronish.accounting.collectives.cp import cp_collectives
from megatronish.accounting.collectives.dp import dp_collectives
from megatronish.accounting.collectives.ep import ep_collectives
from megatronish.accounting.collectives.fp8 import fp8_collectives
from megatronish.accounting.collectives.lora import lora_tp_collectives
from megatronish.accounting.collectives.muon import muon_collectives, qk_clip_collectives
from megatronish.accounting.collectives.pp import pp_collectives
from megatronish.accounting.collectives.step import (
    Collective,
    Purpose,
    Split,
    expert_loads,
    step_agreement,
    step_of,
)
from megatronish.accounting.collectives.tp import tp_collectives
from megatronish.config import Config, Derived

__all__ = [
    "Collective",
    "Purpose",
    "Split",
    "collectives_per_step",
    "formula_bytes_per_step",
    "formula_payload_by_kind",
]


def collectives_per_step(
    cfg: Config, derived: Derived, pp_rank: int = 0, loss_masked: bool | None = None
) -> list[Collective]:
    """Every collective one rank of pipeline stage pp_rank issues in one optimizer step, from
    the config alone, and loss_masked: whether the run's loader masks the loss (SFT data; None:
    data.eod_mask_loss). Each dimension's (see the package doc and its module), in the order
    tp, Muon's tp gathers, cp, QK-clip's, fp8, ep, pp, dp, the routing biases' expert loads,
    then the step agreement; none on a group of one rank or of no call."""
    step = step_of(cfg, derived, pp_rank, loss_masked)
    ops = [
        *lora_tp_collectives(step, tp_collectives(step)),
        *muon_collectives(cfg, derived, pp_rank),
        *cp_collectives(step),
        *qk_clip_collectives(step),
        *fp8_collectives(step),
        *ep_collectives(step),
        *pp_collectives(step),
        *dp_collectives(step),
        *expert_loads(step),
        *step_agreement(step),
    ]
    return [op for op in ops if op.size > 1 and op.count > 0]


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
