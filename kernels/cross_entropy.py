"""Vocab-parallel cross entropy, forward and backward, as Triton kernels.

Shapes: logits [..., v] (v = V / tp, this rank's contiguous vocab shard: rank r holds the global
ids [r v, (r + 1) v)) viewed as [rows, v]; target [...] -> [rows] global ids, -100 ignored;
loss [rows] fp32; lse [rows] fp32 (natural log).

Forward: one program per row reads the shard once in BLOCK-wide chunks, keeping an online max
and sum of exponentials, and picks up the target logit when the target id falls in the shard.
With tp > 1 only per-row statistics cross ranks, through megatronish.distributed.comm (so bytes are
counted): an all-gather of each rank's log-sum-exp [tp, rows] and a SUM all-reduce of the
target logit [rows] (non-zero on the owning rank only). loss = logsumexp over ranks - target.
Backward: grad = (exp(x - lse) - onehot) * dloss, computed in fp32 and stored in the logits'
dtype into a new tensor (the input logits stay intact); no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from megatronish.distributed import comm

from ._utils import check_device

IGNORE_INDEX = -100
_FWD_BLOCK = 4096
_BWD_BLOCK = 4096


@triton.jit
def _ce_fwd_kernel(
    LOGITS, TARGET, LSE, TARGET_LOGIT, n_cols, shard_start,
    BLOCK: tl.constexpr,
):  # fmt: skip
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
def _ce_bwd_kernel(
    LOGITS, TARGET, LSE, DLOSS, DLOGITS, n_cols, shard_start,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    target = tl.load(TARGET + row)
    # An ignored row gets a zero gradient whatever dloss holds.
    dloss = tl.where(target == -100, 0.0, tl.load(DLOSS + row).to(tl.float32))
    x = tl.load(LOGITS + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    grad = tl.exp(x - tl.load(LSE + row)) - tl.where(cols == target - shard_start, 1.0, 0.0)
    tl.store(DLOGITS + row * n_cols + cols, (grad * dloss).to(DLOGITS.dtype.element_ty), mask=mask)


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
    def forward(ctx, logits, target, tp_group):
        check_device(logits, target)
        if logits.shape[:-1] != target.shape:
            raise ValueError(
                f"cross_entropy: target {list(target.shape)} must match logits "
                f"{list(logits.shape)} without the last (vocab) dim"
            )
        tp_size, tp_rank = comm.group_size(tp_group), comm.group_rank(tp_group)
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
            block = min(_FWD_BLOCK, triton.next_power_of_2(n_cols))
            _ce_fwd_kernel[(n_rows,)](
                logits2d, target1d, lse, target_logit, n_cols, shard_start,
                BLOCK=block, num_warps=8 if block >= 2048 else 4,
            )  # fmt: skip
        if tp_size > 1:
            all_lse = torch.empty(tp_size * n_rows, device=lse.device, dtype=lse.dtype)
            comm.all_gather_into(all_lse, lse, tp_group)
            comm.all_reduce(target_logit, tp_group, op=dist.ReduceOp.SUM)
            lse = torch.logsumexp(all_lse.view(tp_size, n_rows), dim=0)
        loss = torch.where(target1d == IGNORE_INDEX, 0.0, lse - target_logit)
        ctx.save_for_backward(logits2d, target1d, lse)
        ctx.shard_start = shard_start
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, dloss):
        logits2d, target1d, lse = ctx.saved_tensors
        n_rows, n_cols = logits2d.shape
        dloss = dloss.contiguous().view(-1)
        dlogits = torch.empty_like(logits2d)
        if n_rows > 0:
            block = min(_BWD_BLOCK, triton.next_power_of_2(n_cols))
            _ce_bwd_kernel[(n_rows, triton.cdiv(n_cols, block))](
                logits2d, target1d, lse, dloss, dlogits, n_cols, ctx.shard_start,
                BLOCK=block, num_warps=8 if block >= 2048 else 4,
            )  # fmt: skip
        return dlogits.view(ctx.logits_shape), None, None


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-token loss [...] in fp32 of this rank's vocab shard logits [..., V / tp] against the
    global target ids [...]; a target of -100 gives loss 0 and no gradient.

    Vocab-parallel over tp_group when it has more than one rank (tp_group None: the default
    group if torch.distributed is initialized, else one device). Forward does one all-gather
    [tp, rows] and one all-reduce [rows] of fp32 statistics; backward does no communication.
    Raises ValueError for a target id outside [0, V) other than -100 (this check syncs with the
    device once per call).
    """
    return _CrossEntropyFunction.apply(logits, target, tp_group)
