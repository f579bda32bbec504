"""Vocab-parallel cross entropy, forward and backward, as Triton kernels.

Shapes: logits [..., v] (v = V / tp, this rank's contiguous vocab shard: rank r holds the global
ids [r v, (r + 1) v)) viewed as [rows, v]; target [...] -> [rows] global ids, -100 ignored;
loss [rows] fp32; lse [rows] fp32 (natural log).

Forward: one program per row reads the shard once in BLOCK-wide chunks, keeping an online max
and sum of exponentials, and picks up the target logit when the target id falls in the shard.
With tp > 1 only per-row statistics cross ranks, and this module does no communication itself:
the caller passes a VocabSplit whose `combine` merges this rank's (lse, target logit) into the
global ones (megatronish.ops does it through megatronish.distributed.comm, so bytes are
counted). loss = global lse - global target logit.
Backward: grad = (exp(x - lse) - onehot) * dloss, computed in fp32 and stored in the logits'
dtype into a new tensor (the input logits stay intact); no communication.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from ._utils import Launch, check_device

IGNORE_INDEX = -100
_FWD_BLOCK = 4096
_BWD_BLOCK = 4096


class VocabSplit(Protocol):
    """A vocab split over `size` tensor-parallel ranks, seen from rank `rank` (its shard of v ids
    holds the global ids [rank v, (rank + 1) v)), with the collectives that merge statistics."""

    rank: int
    size: int

    def combine(
        self, lse: torch.Tensor, target_logit: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global (lse [rows], target logit [rows]) fp32 from this rank's: the log-sum-exp
        over all ranks' lse, and the sum of target_logit (non-zero on the owning rank only)."""
        ...


@triton.jit
def _ce_fwd_kernel(LOGITS, TARGET, LSE, TARGET_LOGIT, n_cols, shard_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * n_cols
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))  # finite: every chunk holds at least one column
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    tl.store(LSE + row, m + tl.log(s))
    local = tl.load(TARGET + row) - shard_start
    in_shard = (local >= 0) & (local < n_cols)
    picked = tl.load(row_ptr + local, mask=in_shard, other=0.0).to(tl.float32)
    tl.store(TARGET_LOGIT + row, tl.where(in_shard, picked, 0.0))


@triton.jit
def _ce_bwd_kernel(LOGITS, TARGET, LSE, DLOSS, DLOGITS, n_cols, shard_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    target = tl.load(TARGET + row)
    # An ignored row gets a zero gradient whatever dloss holds.
    dloss = tl.where(target == -100, 0.0, tl.load(DLOSS + row).to(tl.float32))
    x = tl.load(LOGITS + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    grad = tl.exp(x - tl.load(LSE + row)) - tl.where(cols == target - shard_start, 1.0, 0.0)
    tl.store(DLOGITS + row * n_cols + cols, (grad * dloss).to(DLOGITS.dtype.element_ty), mask=mask)


def _block(n_cols: int, limit: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of n_cols logits: BLOCK-wide chunks, at most limit."""
    block = min(limit, triton.next_power_of_2(n_cols))
    return block, 8 if block >= 2048 else 4


def ce_forward_launch(
    logits2d: torch.Tensor,
    target1d: torch.Tensor,
    lse: torch.Tensor,
    target_logit: torch.Tensor,
    shard_start: int,
) -> Launch:
    """The forward launch: per row of logits2d [rows, v] (this rank's shard, whose first id is
    shard_start), the shard's lse and target logit [rows] fp32; target1d [rows] int64."""
    n_rows, n_cols = logits2d.shape
    block, warps = _block(n_cols, _FWD_BLOCK)
    return Launch(
        _ce_fwd_kernel,
        grid=(n_rows,),
        args=(logits2d, target1d, lse, target_logit, n_cols, shard_start),
        constexprs=dict(BLOCK=block),
        num_warps=warps,
    )


def ce_backward_launch(
    logits2d: torch.Tensor,
    target1d: torch.Tensor,
    lse: torch.Tensor,
    dloss: torch.Tensor,
    dlogits: torch.Tensor,
    shard_start: int,
) -> Launch:
    """The backward launch: dlogits [rows, v] from the global lse and dloss [rows]."""
    n_rows, n_cols = logits2d.shape
    block, warps = _block(n_cols, _BWD_BLOCK)
    return Launch(
        _ce_bwd_kernel,
        grid=(n_rows, triton.cdiv(n_cols, block)),
        args=(logits2d, target1d, lse, dloss, dlogits, n_cols, shard_start),
        constexprs=dict(BLOCK=block),
        num_warps=warps,
    )


def _check_targets(target: torch.Tensor, vocab: int) -> None:
    bad = ((target < 0) | (target >= vocab)) & (target != IGNORE_INDEX)
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"cross_entropy: target id {value} is outside the vocabulary [0, {vocab}) "
            f"and is not the ignore index {IGNORE_INDEX}"
        )


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, split: VocabSplit | None):
        check_device(logits, target)
        if logits.shape[:-1] != target.shape:
            raise ValueError(
                f"cross_entropy: target {list(target.shape)} must match logits "
                f"{list(logits.shape)} without the last (vocab) dim"
            )
        tp_size, tp_rank = (split.size, split.rank) if split is not None else (1, 0)
        n_cols = logits.shape[-1]
        if n_cols == 0:
            raise ValueError("cross_entropy: the vocab shard (last dim of logits) is empty")
        _check_targets(target, n_cols * tp_size)
        logits2d = logits.contiguous().view(-1, n_cols)
        target1d = target.contiguous().view(-1).to(torch.int64)
        n_rows = logits2d.shape[0]
        lse = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
        target_logit = torch.empty_like(lse)
        shard_start = tp_rank * n_cols
        if n_rows > 0:
            ce_forward_launch(logits2d, target1d, lse, target_logit, shard_start).run()
        if split is not None:
            lse, target_logit = split.combine(lse, target_logit)
        loss = torch.where(target1d == IGNORE_INDEX, 0.0, lse - target_logit)
        ctx.save_for_backward(logits2d, target1d, lse)
        ctx.shard_start = shard_start
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, dloss):
        logits2d, target1d, lse = ctx.saved_tensors
        dloss = dloss.contiguous().view(-1)
        dlogits = torch.empty_like(logits2d)
        if logits2d.shape[0] > 0:
            launch = ce_backward_launch(logits2d, target1d, lse, dloss, dlogits, ctx.shard_start)
            launch.run()
        return dlogits.view(ctx.logits_shape), None, None


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, split: VocabSplit | None = None
) -> torch.Tensor:
    """Per-token loss [...] in fp32 of this rank's vocab shard logits [..., V / tp] against the
    global target ids [...]; a target of -100 gives loss 0 and no gradient.

    split None: the whole vocab is on this device. Otherwise the vocab is split over split.size
    ranks and the forward calls split.combine once on the per-row statistics (fp32 [rows] lse
    and target logit); the backward does no communication. ops.cross_entropy builds the split
    of a tp process group. Raises ValueError for a target id outside [0, V) other than -100
    (this check syncs with the device once per call).
    """
    return _CrossEntropyFunction.apply(logits, target, split)
