"""The vocab-parallel cross-entropy kernel against F.cross_entropy on the full logits.

One device, and two gloo ranks each holding half of the vocabulary; targets in either shard,
ignored positions (-100), and a row with huge logits. On CPU the kernels run under Triton's
interpreter (set before they are imported).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatronish import ops
from megatronish.distributed.comm import CommCounter
from tests.kernel_env import kernels
from tests.ranks import run_on_ranks
from tests.tolerances import CE_GRAD_ABS, CE_GRAD_SMALL_ABS, FP32_REORDER

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_problem(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits [rows, vocab] and targets [rows] with ids at both ends of the vocabulary,
    in the middle, ignored (-100), and one row of very large logits."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[1] += 100.0  # exp(100) overflows fp32: needs the running max
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[0], target[1], target[2] = 0, vocab - 1, vocab // 2
    target[3] = target[rows - 1] = -100
    return logits, target


def reference_loss_and_grad(logits, target, upstream, dtype=torch.float32):
    full = logits.detach().to(dtype).requires_grad_(True)
    loss = F.cross_entropy(full, target, reduction="none", ignore_index=-100)
    (grad,) = torch.autograd.grad(loss, full, upstream.to(dtype))
    return loss, grad


@pytest.mark.parametrize("vocab", [67, 5000])  # 5000 > the 4096 block: the online loop runs
def test_single_device_matches_torch_fp32_and_float64(vocab):
    logits, target = make_problem(11, vocab, seed=1)
    upstream = torch.rand(11, generator=torch.Generator().manual_seed(2)) + 0.5
    x = logits.to(DEVICE).requires_grad_(True)
    loss = kernels.cross_entropy(x, target.to(DEVICE), None)
    (grad,) = torch.autograd.grad(loss, x, upstream.to(DEVICE))
    assert loss.dtype == torch.float32 and grad.dtype == x.dtype
    for dtype in (torch.float32, torch.float64):
        want_loss, want_grad = reference_loss_and_grad(logits, target, upstream, dtype)
        torch.testing.assert_close(
            loss.cpu().to(dtype), want_loss, atol=FP32_REORDER, rtol=FP32_REORDER
        )
        torch.testing.assert_close(
            grad.cpu().to(dtype), want_grad, atol=CE_GRAD_ABS, rtol=FP32_REORDER
        )
    assert torch.equal(x.detach().cpu(), logits), "the input logits must stay intact"
    assert loss[3] == 0 and loss[10] == 0 and not grad[3].any() and not grad[10].any()


def test_leading_dims_and_non_contiguous_logits():
    logits, target = make_problem(12, 67, seed=3)
    upstream = torch.rand(12, generator=torch.Generator().manual_seed(4))
    # [3, 4, V] built as a transpose of [4, 3, V]: non-contiguous, as a [s, b] layout gives.
    x = logits.view(4, 3, 67).transpose(0, 1).to(DEVICE).requires_grad_(True)
    tgt = target.view(4, 3).t().to(DEVICE)
    assert not x.is_contiguous()
    loss = kernels.cross_entropy(x, tgt, None)
    assert loss.shape == (3, 4)
    (grad,) = torch.autograd.grad(loss, x, upstream.view(4, 3).t().to(DEVICE))
    want_loss, want_grad = reference_loss_and_grad(
        logits.view(4, 3, 67).transpose(0, 1).reshape(12, 67), tgt.reshape(12).cpu(),
        upstream.view(4, 3).t().reshape(12),
    )  # fmt: skip
    torch.testing.assert_close(
        loss.reshape(12).cpu(), want_loss, atol=FP32_REORDER, rtol=FP32_REORDER
    )
    torch.testing.assert_close(
        grad.reshape(12, 67).cpu(), want_grad, atol=CE_GRAD_SMALL_ABS, rtol=FP32_REORDER
    )


def test_targets_outside_the_vocabulary_are_rejected():
    logits = torch.randn(4, 67, device=DEVICE)
    for bad in (67, -1, -101):
        with pytest.raises(ValueError, match=f"target id {bad}"):
            kernels.cross_entropy(logits, torch.tensor([0, bad, 3, 4], device=DEVICE), None)


def test_ops_backend_triton_dispatches_to_the_kernel():
    logits, target = make_problem(9, 67, seed=5)
    x = logits.to(DEVICE).requires_grad_(True)
    loss = ops.cross_entropy(x, target.to(DEVICE), backend="triton")
    assert type(loss.grad_fn).__name__.startswith("_CrossEntropyFunction")
    want, _ = reference_loss_and_grad(logits, target, torch.ones(9))
    torch.testing.assert_close(loss.detach().cpu(), want, atol=FP32_REORDER, rtol=FP32_REORDER)


def test_ops_backend_triton_matches_backend_torch():
    pytest.importorskip("megatronish.layers.cross_entropy", reason="the torch loss layer")
    logits, target = make_problem(9, 67, seed=6)
    upstream = torch.rand(9, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    results = []
    for backend in ("triton", "torch"):
        x = logits.to(DEVICE).requires_grad_(True)
        loss = ops.cross_entropy(x, target.to(DEVICE), backend=backend)
        results.append((loss, *torch.autograd.grad(loss, x, upstream)))
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(
            ours, theirs.to(ours.dtype), atol=FP32_REORDER, rtol=FP32_REORDER
        )


def _vocab_parallel_rank(rank: int, world_size: int, rows: int, vocab: int, seed: int):
    """On one gloo rank: the loss and the gradient of this rank's shard, once through the default
    group (tp_group=None) and once through an explicit group, plus the collectives counted."""
    logits, target = make_problem(rows, vocab, seed)
    shard_size = vocab // world_size
    shard = logits[:, rank * shard_size : (rank + 1) * shard_size].contiguous()
    upstream = torch.rand(rows, generator=torch.Generator().manual_seed(seed + 1)) + 0.5
    results = {}
    for name, group in (("default", None), ("explicit", dist.new_group(list(range(world_size))))):
        x = shard.clone().requires_grad_(True)
        with CommCounter() as counter:
            loss = ops.cross_entropy(x, target, group, backend="triton")
            (grad,) = torch.autograd.grad(loss, x, upstream)
        results[name] = dict(
            loss=loss.tolist(), grad=grad.tolist(), intact=torch.equal(x.detach(), shard),
            calls=dict(counter.calls), payload=dict(counter.payload_bytes),
        )  # fmt: skip
    return results


def test_two_rank_vocab_parallel_matches_torch_on_the_full_logits():
    rows, vocab, world_size = 10, 74, 2  # each rank holds 37 ids
    per_rank = run_on_ranks(_vocab_parallel_rank, world_size, rows, vocab, 11, timeout=120)
    logits, target = make_problem(rows, vocab, seed=11)
    upstream = torch.rand(rows, generator=torch.Generator().manual_seed(12)) + 0.5
    want_loss, want_grad = reference_loss_and_grad(logits, target, upstream, torch.float64)
    for name in ("default", "explicit"):
        results = [rank_result[name] for rank_result in per_rank]
        for rank_result in results:
            loss = torch.tensor(rank_result["loss"], dtype=torch.float64)
            torch.testing.assert_close(loss, want_loss, atol=FP32_REORDER, rtol=FP32_REORDER)
            assert rank_result["intact"], "the input logits must stay intact"
            # Per-row statistics only: an all-gather of [2, rows] lse and one all-reduce [rows].
            assert rank_result["calls"] == {"all_gather": 1, "all_reduce": 1}
            assert rank_result["payload"] == {"all_gather": world_size * rows * 4,
                                              "all_reduce": rows * 4}  # fmt: skip
        grad = torch.cat([torch.tensor(r["grad"], dtype=torch.float64) for r in results], dim=1)
        torch.testing.assert_close(grad, want_grad, atol=CE_GRAD_ABS, rtol=FP32_REORDER)
        assert not grad[3].any() and not grad[rows - 1].any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_bf16_logits_on_cuda_give_a_bf16_gradient_as_accurate_as_torch():
    logits, target = make_problem(64, 50_000, seed=13)
    upstream = torch.rand(64, generator=torch.Generator().manual_seed(14))
    x = logits.to("cuda", torch.bfloat16).requires_grad_(True)
    loss = kernels.cross_entropy(x, target.cuda(), None)
    (grad,) = torch.autograd.grad(loss, x, upstream.cuda())
    assert grad.dtype == torch.bfloat16
    exact_loss, exact_grad = reference_loss_and_grad(x.cpu(), target, upstream, torch.float64)
    torch_loss, torch_grad = reference_loss_and_grad(x, target.cuda(), upstream.cuda(), x.dtype)
    for ours, theirs, exact in ((loss, torch_loss, exact_loss), (grad, torch_grad, exact_grad)):
        ours_err = (ours.double().cpu() - exact).abs().max()
        torch_err = (theirs.double().cpu() - exact).abs().max()
        assert ours_err <= 2 * torch_err + 1e-3, (ours_err, torch_err)
