"""Pipeline parallelism: what a rank of stage pp_rank issues to the other stages (pp > 1).

Per micro-batch a stage sends its fp32 hidden states [b, s, h] ([b, s/t, h] under sequence
parallelism) forward (all but the last stage) and their gradient backward (all but the first),
counted as sent once ("p2p"); with pp_virtual = v it does so for each of its v model chunks (per
micro-batch 2 v - 1 sends on the first and the last stage, 2 v on the others). Per step the
first and the last stage all-reduce the tied embedding's gradient (fp32, their vocab shard) over
their two-rank "embedding" group (so do the copies that multi-token prediction keeps on the last
stage), and the grad-norm partial sum (fp64) and the last stage's loss (fp32; with multi-token
prediction its loss too) are all-reduced over the pipeline.
"""

from __future__ import annotations

from megatronish.accounting.collectives.step import (
    FP32_BYTES,
    FP64_BYTES,
    Collective,
    Purpose,
    Step,
    loss_bytes,
)


def pp_collectives(step: Step) -> list[Collective]:
    """The sends, the tied embedding's gradient, the norm and the loss (see module doc)."""
    derived, pp = step.derived, step.derived.pp
    if pp == 1:
        return []
    hidden = step.b * (step.s // step.tp if step.sp else step.s) * step.h * FP32_BYTES
    # Per model chunk: its output forward (all but the model's last chunk) and its input
    # gradient backward (all but chunk 0).
    v = derived.pp_virtual
    sends = (v - (1 if step.last else 0)) + (v - (1 if step.first else 0))
    what = "hidden states and their gradients (point to point)"
    ops = [Collective(what, "p2p", "pp", pp, hidden, sends * step.accum, Purpose.ACTIVATION)]
    if derived.last_stage_embedding and (step.first or step.last):
        shard = derived.padded_vocab_size // step.tp * step.h * FP32_BYTES
        what = "tied embedding gradient (first and last stage)"
        ops.append(
            Collective(what, "all_reduce", "embedding", 2, shard, 1, Purpose.GRADIENT_REDUCTION)
        )
    return ops + [
        Collective(
            "gradient norm over the stages",
            "all_reduce",
            "pp",
            pp,
            FP64_BYTES,
            1,
            Purpose.GRADIENT_NORM,
        ),
        Collective(
            "loss from the last stage", "all_reduce", "pp", pp, loss_bytes(step), 1, Purpose.LOSS
        ),
    ]
