"""Expert parallelism: what a rank issues over its ep group (MoE, ep > 1; the expert
gradients' data-parallel sums are dp's).

Per micro-batch and MoE layer (dropless; T = b s tokens, k top_k, E experts, h hidden): one
all-to-all of the E int64 per-expert counts, and four of c [T k, h] (dispatch and return,
forward and backward: the T k routed rows go out twice, and the rows the rank received from the
others twice, which are T k per rank on average: exact summed over the ep group). Full
recompute reruns the layer's forward in backward: its counts and its dispatch and return once
more. Per step the expert gradient norm's partial sum (one fp64).
"""

from __future__ import annotations

from megatronish.accounting.collectives.step import (
    FP64_BYTES,
    INT64_BYTES,
    Collective,
    Purpose,
    Step,
)


def ep_collectives(step: Step) -> list[Collective]:
    """The all-to-alls of the stage's MoE layers and the expert gradient norm (module doc)."""
    moe, ep, calls = step.cfg.model.moe, step.derived.ep, step.moe_layers * step.accum
    rows = step.b * step.s * moe.top_k * step.h * step.operand_bytes  # every token's top_k copies
    counts = moe.num_experts * INT64_BYTES
    dispatch = "MoE token dispatch and return (forward, backward)"
    norm = "expert gradient norm over the ep group"
    forwards = 2 if step.cfg.train.activation_checkpointing == "full" else 1
    return [
        Collective(
            "MoE per-expert counts (forward)",
            "all_to_all",
            "ep",
            ep,
            counts,
            forwards * calls,
            Purpose.ROUTING,
        ),
        Collective(
            dispatch, "all_to_all", "ep", ep, rows, (2 * forwards + 2) * calls, Purpose.ACTIVATION
        ),
        Collective(norm, "all_reduce", "ep", ep, FP64_BYTES, 1, Purpose.GRADIENT_NORM),
    ]
