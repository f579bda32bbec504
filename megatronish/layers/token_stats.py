"""Per-token log-probabilities and entropies from this tp rank's vocab shard of the logits,
with the reductions the vocab-parallel loss uses and never the whole vocabulary on a rank.

Shapes: logits [..., V / t] (this rank's contiguous block of the vocab, padding ids at -inf),
targets [...] global ids (-100: no target). Every tp rank returns the same values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatronish import ops
from megatronish.distributed import comm


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None, backend: str
) -> torch.Tensor:
    """log p(target) in fp32 [...], differentiable: minus the vocab-parallel cross entropy
    (ops.cross_entropy: a max all-reduce, then one of the target logit and the sum of exp);
    0 where the target is -100."""
    return -ops.cross_entropy(logits, targets, group, backend=backend).float()


@torch.no_grad()
def token_entropies(logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The entropy of each position's distribution, fp32 [...]: with m the row max and
    z = logits - m, H = log sum exp z - sum exp(z) z / sum exp z, from a max all-reduce and
    one all-reduce of the two sums over the tp group."""
    logits32 = logits.float()
    row_max = logits32.max(dim=-1).values
    comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
    shifted = logits32 - row_max.unsqueeze(-1)
    exp = shifted.exp()
    weighted = (exp * shifted.masked_fill(exp == 0, 0.0)).sum(dim=-1)  # padding ids: 0 * -inf
    stats = torch.stack([exp.sum(dim=-1), weighted]).contiguous()  # [2, ...]
    comm.all_reduce(stats, group)
    sum_exp, weighted = stats[0], stats[1]
    return sum_exp.log() - weighted / sum_exp
