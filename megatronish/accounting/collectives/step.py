"""What every dimension's count shares: ``Collective`` (one kind of call and its bytes),
``Step`` (the sizes of one rank's optimizer step, legend in the package doc) and the step
agreement every rank joins at the end of a step."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from megatronish.accounting.parameters import last_stage_mtp, stage_blocks, stage_moe_layers
from megatronish.config import Config, Derived

FP32_BYTES = 4
FP64_BYTES = 8
INT64_BYTES = 8
GRAD_REDUCE_BYTES = {"fp32": 4, "bf16": 2}  # optim.grad_reduce_dtype: bytes an element sent
STEP_FLAGS = 4  # faults.agree_on_step: loss and grad_norm non-finite, stop, writer busy


Kind = Literal[
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p", "cp_ring",
    "tp_ring", "cp_state",
]  # fmt: skip
"""The call on the wire, as ``comm.CommCounter`` keys it."""
GroupName = Literal["tp", "cp", "tp_cp", "dp", "ep", "pp", "embedding", "world"]
"""The ranks it runs over; "dp" is the data-parallel group, dp x cp ranks (or the experts')."""


class Purpose(Enum):
    """What a collective carries."""

    ACTIVATION = "activations or their gradients between shards, stages or experts"
    ROUTING = "MoE routing: counts, combine weights, the tokens' experts, expert loads"
    GRADIENT_REDUCTION = "parameter gradients summed or averaged"
    PARAMETERS = "ZeRO's parameter gathers and broadcasts"
    FP8_AMAX = "fp8 scales' amaxes"
    LOSS = "the loss's statistics, token counts and reported value"
    GRADIENT_NORM = "gradient norms' partial sums"
    AGREEMENT = "the step agreement's flags"
    OPTIMIZER = "Muon's matrices gathered whole over tp for Newton-Schulz"


class Split(Enum):
    """How parallel.tp_comm_overlap issues a collective: whole, or decomposed under a GEMM as
    t - 1 ring hops of a sequence chunk or as t all-reduces of a chunk."""

    WHOLE = ""
    RING = "ring"
    CHUNKS = "chunks"


@dataclass(frozen=True)
class Collective:
    """One kind of collective a training step issues: `count` calls of `payload` bytes each on
    the `group` of `size` ranks. payload is what ``comm`` counts: the tensor of an all-reduce
    or broadcast, the full (gathered) tensor of an all-gather or reduce-scatter."""

    what: str
    """What it carries, as ``check`` names it (a decomposed one: before its split)."""
    kind: Kind
    group: GroupName
    size: int
    payload: int
    count: int
    purpose: Purpose
    under: str = ""
    """For a collective parallel.tp_comm_overlap decomposes: the GEMM it runs under
    (accounting.layer_time.linear_gemms' name); "" for every other."""
    split: Split = Split.WHOLE

    @property
    def sent(self) -> float:
        """Bytes this rank sends for all `count` calls: ring all-reduce 2 (n-1)/n x payload,
        all-gather, reduce-scatter and broadcast (n-1)/n x payload, a point-to-point send or
        ring hop its payload."""
        if self.kind in ("p2p", "cp_ring", "tp_ring", "cp_state"):
            return self.count * self.payload
        factor = (2 if self.kind == "all_reduce" else 1) * (self.size - 1) / self.size
        return self.count * self.payload * factor


@dataclass(frozen=True)
class Step:
    """One rank of pipeline stage pp_rank in one optimizer step (``step_of``): the config, its
    derived layout and the sizes every dimension's count reads (tp the tp degree, accum
    micro-batches a step, b micro-batch, h hidden)."""

    cfg: Config
    derived: Derived
    pp_rank: int
    masked: bool
    """Whether the run's loader masks the loss (SFT data or data.eod_mask_loss)."""
    first: bool
    """The first stage: it holds the embeddings."""
    last: bool
    """The last stage: it holds the output layer and the loss."""
    tp: int
    cp: int
    dp_cp: int
    """The data-parallel group, dp x cp ranks: the data-parallel collectives run over it."""
    accum: int
    b: int
    s: int
    """A rank's share of the sequence, seq_len / cp."""
    h: int
    operand_bytes: int
    """Bytes of a matmul operand: 2 under bf16 autocast, 4 in fp32."""
    sp: bool
    """Sequence parallelism in effect (on, and tp > 1)."""
    overlap: bool
    """parallel.tp_comm_overlap in effect (on, and tp > 1): the linears' collectives decomposed."""
    layers: int
    moe_layers: int
    """Transformer layers (the multi-token prediction blocks of the last stage included) and
    MoE layers of the stage."""
    linear_layers: int
    """Of `layers`, the linear-attention blocks (model.layer_types): no ring, their recurrent
    state and convolution tail passed along the cp ranks instead."""
    mtp: int
    """Multi-token prediction modules of the stage (model.mtp_depth on the last, else 0): each
    looks tokens up, calls the output layer and the loss once more per micro-batch."""


def step_of(cfg: Config, derived: Derived, pp_rank: int, loss_masked: bool | None) -> Step:
    """The Step of stage pp_rank; loss_masked None: data.eod_mask_loss."""
    train = cfg.train
    cp = derived.cp
    return Step(
        cfg=cfg,
        derived=derived,
        pp_rank=pp_rank,
        masked=cfg.data.eod_mask_loss if loss_masked is None else loss_masked,
        first=pp_rank == 0,
        last=pp_rank == derived.pp - 1,
        tp=derived.tp,
        cp=cp,
        dp_cp=derived.dp * cp,
        accum=derived.grad_accum_steps,
        b=train.micro_batch_size,
        s=train.seq_len // cp,
        h=cfg.model.d_model,
        operand_bytes=2 if train.bf16_autocast else FP32_BYTES,
        sp=cfg.parallel.sequence_parallel and derived.tp > 1,
        overlap=cfg.parallel.tp_comm_overlap and derived.tp > 1,
        layers=derived.stage_layers[pp_rank] + last_stage_mtp(cfg, derived, pp_rank),
        moe_layers=stage_moe_layers(derived, pp_rank),
        linear_layers=sum(
            cfg.model.block_attention(i) == "gated_deltanet" for i in stage_blocks(derived, pp_rank)
        ),
        mtp=last_stage_mtp(cfg, derived, pp_rank),
    )


def loss_bytes(step: Step) -> int:
    """The reported losses' all-reduce (training/loss.py mean_losses): the loss, and the
    multi-token prediction loss with model.mtp_depth, fp32."""
    return (2 if step.cfg.model.mtp_depth else 1) * FP32_BYTES


def moe_count_bytes(step: Step) -> int:
    """Bytes of one MoE layer's routed counts summed over cp (and tp under sequence
    parallelism) per micro-batch: E int64, or b x E (each sequence's) with the sequence-wise
    balancing loss."""
    moe = step.cfg.model.moe
    return (step.b if moe.seq_aux_loss_coef else 1) * moe.num_experts * INT64_BYTES


def expert_loads(step: Step) -> list[Collective]:
    """moe.balance (sigmoid router): every MoE layer's per-expert loads of the step, int64,
    all-reduced over all ranks once per step."""
    moe, derived = step.cfg.model.moe, step.derived
    if not derived.moe_layers or moe.router != "sigmoid":
        return []
    payload = len(derived.moe_layers) * moe.num_experts * INT64_BYTES
    what = "MoE expert loads of the global batch (routing biases)"
    return [
        Collective(what, "all_reduce", "world", derived.world_size, payload, 1, Purpose.ROUTING)
    ]


def step_agreement(step: Step) -> list[Collective]:
    """faults.agree_on_step: four fp32 flags (16 bytes) all-reduced over tp, then dp x cp, then
    pp, once per step."""
    groups = (("tp", step.tp), ("dp", step.dp_cp), ("pp", step.derived.pp))
    what = "step agreement: non-finite and stop flags"
    return [
        Collective(what, "all_reduce", group, size, STEP_FLAGS * FP32_BYTES, 1, Purpose.AGREEMENT)
        for group, size in groups
    ]
