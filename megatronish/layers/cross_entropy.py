"""Cross entropy over logits whose vocab dim is split across the tp group.

Shapes: N tokens (any leading dims), V vocab, t tp group size.
  logits [..., V / t] (this rank's contiguous block of the vocab), target [...] global ids
  -> loss [...] per token (0 where target == -100)
Forward: two small all-reduces per row (the max; then the target logit and the sum of exp
together). Backward: no communication, each rank writes the gradient of its own block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatronish.distributed import comm

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        tp_size, tp_rank = comm.group_size(group), comm.group_rank(group)
        local_vocab = logits.shape[-1]
        start = tp_rank * local_vocab
        logits32 = logits.float()
        row_max = logits32.max(dim=-1).values
        comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = logits32 - row_max.unsqueeze(-1)

        ignored = target == IGNORE_INDEX
        local_target = target - start
        outside = (local_target < 0) | (local_target >= local_vocab) | ignored
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = shifted.exp_()  # shifted is our own fp32 copy: reuse it for exp and the softmax
        stats = torch.stack([target_logit, exp.sum(dim=-1)])  # [2, ...]
        if tp_size > 1:
            stats = stats.contiguous()
            comm.all_reduce(stats, group)
        target_logit, sum_exp = stats[0], stats[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target), scaled by the incoming gradient; built
        # in the saved softmax buffer (used once: this graph is not retained for a second pass).
        grad = softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-token loss of this rank's vocab shard of the logits against global target ids;
    -100 is ignored (loss 0, no gradient). With one rank it equals F.cross_entropy."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
