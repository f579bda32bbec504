"""Context parallelism: what a rank issues over its cp group (nothing at cp = 1 but the loss
mask's count, which runs over the whole data-parallel group).

Per micro-batch and layer the ring attention sends ("cp_ring") its k and v, c [b, k/t, s, d + e]
with k kv heads (only those travel; n under multi-head latent attention), d the query-key and e
the value head dim, cp - 1 times forward and again backward, plus cp hops of
their fp32 gradient accumulator backward; attention recompute (selective or full) reruns the
forward ring. Per micro-batch and MoE layer the E int64 routed counts of the balancing loss
(b x E, each sequence's, with the sequence-wise balancing loss).

A linear-attention block (model.layer_types) has no ring: each piece of the sequence starts
from the recurrent state and convolution tail of the piece before it, passed rank to rank in
sequence order ("cp_state": the zigzag's pieces visit ranks 0, 1, ..., cp - 1, cp - 1, ..., 0,
so the chain serializes the ranks and a rank sends to each neighbour it has, two at cp > 2 for
all but the ends), forward, backward (their gradients) and once more per forward rerun by
recompute; per sequence and layer the state [v/t, e, f] in fp32 and the tail [K - 1, c/t]
(accounting.components.gated_deltanet.state_bytes). The busiest rank's are counted.

The loss divides by the tokens it counts: without a loss mask the last stage all-reduces its
token count (one fp64) over cp per micro-batch; with one it instead all-reduces the counted
tokens of the global batch (one fp64) over the data-parallel group dp x cp once per step
(training/loss.py), at cp = 1 too. Each multi-token prediction module's loss does the same:
one more count per micro-batch, or one more fp64 in the step's all-reduce. The ring counts its
blocks as layers.
"""

from __future__ import annotations

from megatronish.accounting.collectives.step import (
    FP32_BYTES,
    FP64_BYTES,
    Collective,
    Purpose,
    Step,
    moe_count_bytes,
)
from megatronish.accounting.components.gated_deltanet import state_bytes


def cp_collectives(step: Step) -> list[Collective]:
    """The ring's, the MoE balancing loss's and the loss's token counts (see module doc)."""
    cp, accum, n = step.cp, step.accum, step.layers - step.linear_layers
    act, loss = Purpose.ACTIVATION, Purpose.LOSS
    derived = step.derived
    heads = derived.n_kv_head // step.tp
    kv = step.b * heads * step.s * (derived.head_dim + derived.v_head_dim)  # elements
    forward_rings = 2 if step.cfg.train.activation_checkpointing != "none" else 1
    hops = (cp - 1) * (forward_rings + 1) * n * accum
    what = "ring attention k and v (forward, backward)"
    ops = [Collective(what, "cp_ring", "cp", cp, kv * step.operand_bytes, hops, act)]
    what = "ring attention dk and dv accumulator (backward)"
    ops.append(Collective(what, "cp_ring", "cp", cp, kv * FP32_BYTES, cp * n * accum, act))
    if step.linear_layers:
        state = step.b * state_bytes(step.cfg.model, derived, step.operand_bytes)
        neighbours = min(2, cp - 1)
        passes = neighbours * (forward_rings + 1) * step.linear_layers * accum
        what = "linear attention state and convolution tail (forward, backward)"
        ops.append(Collective(what, "cp_state", "cp", cp, state, passes, act))
    counts, calls = moe_count_bytes(step), step.moe_layers * accum
    what = "MoE routed counts for the balancing loss"
    ops.append(Collective(what, "all_reduce", "cp", cp, counts, calls, Purpose.ROUTING))
    losses = 1 + step.mtp  # the main loss's and each multi-token prediction module's
    if step.last and not step.masked:
        what = "loss token count"
        ops.append(Collective(what, "all_reduce", "cp", cp, FP64_BYTES, losses * accum, loss))
    if step.last and step.masked:
        what = "counted tokens of the global batch (loss mask)"
        ops.append(Collective(what, "all_reduce", "dp", step.dp_cp, losses * FP64_BYTES, 1, loss))
    return ops
