"""The grouped GEMM (expert FFNs): the Triton kernel, forward and both gradients, equals a
float64 computation under Triton's interpreter at sizes that are not multiples of its blocks,
with empty groups and a transposed weight view; the torch loop equals a per-row product in
float64; both backends agree through megatronish.ops."""

from __future__ import annotations

import pytest
import torch

from megatronish import ops
from megatronish.ops import reference
from tests.kernel_env import kernels
from tests.tolerances import BF16_GEMM, EXACT, FP32_REORDER, FP64_REORDER, U_FP32

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _case(counts: list[int], k: int, n: int, dtype=torch.float32, seed: int = 0):
    """x [A, k], w as the transpose view of a [G, n, k] weight, int32 offsets, upstream dy."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    weight = torch.randn(len(counts), n, k, generator=gen, dtype=torch.float64) / k**0.5
    dy = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    move = dict(device=DEVICE, dtype=dtype)
    return x.to(**move), weight.to(**move), offsets.to(DEVICE), dy.to(**move)


def _grads(fn, x, weight, offsets, dy):
    x = x.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    y = fn(x, weight.transpose(1, 2), offsets)
    y.backward(dy)
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("counts", [[5, 0, 70, 3], [0, 0, 9], [0, 0]])
def test_kernel_forward_and_gradients_equal_float64_with_empty_groups(counts):
    x, weight, offsets, dy = _case(counts, k=40, n=72)
    got = _grads(kernels.grouped_mm, x, weight, offsets, dy)
    want = _grads(reference.grouped_mm, x.double(), weight.double(), offsets, dy.double())
    for name, g, w in zip(("y", "dx", "dw"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=FP32_REORDER, atol=FP32_REORDER, msg=name)


@pytest.mark.parametrize("k, n", [(4, 12), (12, 4)], ids=["lora-a", "lora-b"])
def test_kernel_at_the_experts_lora_ranks_equals_float64(k, n):
    """The experts' LoRA adapters (moe.adapters) run it with the rank as k or n."""
    x, weight, offsets, dy = _case([5, 0, 7, 3], k=k, n=n)
    got = _grads(kernels.grouped_mm, x, weight, offsets, dy)
    want = _grads(reference.grouped_mm, x.double(), weight.double(), offsets, dy.double())
    for name, g, w in zip(("y", "dx", "dw"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=FP32_REORDER, atol=FP32_REORDER, msg=name)


def test_torch_loop_equals_a_per_row_product_in_float64():
    x, weight, offsets, _ = _case([3, 0, 4, 1], k=6, n=5, dtype=torch.float64)
    w = weight.transpose(1, 2)
    group_of = torch.repeat_interleave(torch.arange(4), torch.tensor([3, 0, 4, 1]))
    per_row = torch.stack([x[r] @ w[group_of[r]] for r in range(x.shape[0])])
    torch.testing.assert_close(
        reference.grouped_mm(x, w, offsets), per_row, rtol=FP64_REORDER, atol=FP64_REORDER
    )
    one = torch.tensor([x.shape[0]], dtype=torch.int32)
    assert torch.equal(reference.grouped_mm(x, w[:1], one), x @ w[0])
    empty = reference.grouped_mm(x[:0], w, torch.zeros(4, dtype=torch.int32))
    assert empty.shape == (0, 5)


def test_ops_grouped_mm_backends_agree():
    x, weight, offsets, dy = _case([7, 2, 0, 11], k=24, n=17, seed=1)
    triton = _grads(lambda *a: ops.grouped_mm(*a, backend="triton"), x, weight, offsets, dy)
    torch_ = _grads(lambda *a: ops.grouped_mm(*a, backend="torch"), x, weight, offsets, dy)
    for g, w in zip(triton, torch_):
        torch.testing.assert_close(g, w, rtol=FP32_REORDER, atol=FP32_REORDER)


@pytest.mark.cuda
@requires_cuda
def test_kernel_bf16_is_close_to_float64():
    x, weight, offsets, dy = _case([300, 0, 129, 64], k=256, n=512, dtype=torch.bfloat16)
    got = _grads(kernels.grouped_mm, x, weight, offsets, dy)
    want = _grads(reference.grouped_mm, x.double(), weight.double(), offsets, dy.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=BF16_GEMM, atol=BF16_GEMM)


def test_an_moe_layer_on_the_kernels_equals_it_on_torch():
    """The expert path as the model runs it on CUDA: stacked weights through transposed views,
    the SwiGLU kernel between two grouped GEMMs, an expert with no tokens."""
    from megatronish.config import derive, load_config
    from megatronish.distributed.layout import ParallelState
    from megatronish.layers.plan import PLAIN
    from megatronish.moe import MoELayer

    sets = ["model.arch=llama", "model.d_model=32", "model.n_head=2", "model.vocab_size=64",
            "model.moe.num_experts=4", "model.moe.d_ff=24"]  # fmt: skip
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2), device=DEVICE)
    results = []
    for backend in ("torch", "triton"):
        cfg = load_config(None, [*sets, f"kernels.backend={backend}"])
        torch.manual_seed(0)
        ps = ParallelState.single(DEVICE)
        layer = MoELayer(cfg.model, derive(cfg, 1), ps, PLAIN, backend, False).to(DEVICE)
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.3, generator=torch.Generator(DEVICE).manual_seed(1))
            layer.router.weight[3] = -5.0  # expert 3 gets nothing
        inputs = x.clone().abs().requires_grad_(True)
        out = layer(inputs)
        out.square().sum().backward()
        results.append([out, inputs.grad, *(p.grad for p in layer.parameters())])
    # Each value comes from a chain of at most four fp32 sums (two grouped GEMMs forward, two
    # back) of up to K = 32 terms that the two backends add in other orders: within 4 K u of
    # the tensor's largest magnitude (u = 2^-24), where a wrong row or expert is off by its size.
    for got, want in zip(results[1], results[0]):
        bound = 4 * 32 * U_FP32 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=EXACT, atol=bound)
