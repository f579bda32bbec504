"""The gated delta rule's Triton kernels (megatronish_kernels.gated_delta, under Triton's
interpreter on CPU, in fp32) against the float64 recurrence: outputs, the final state and every
gradient, the initial state's included, at a sequence of whole and partial chunks, grouped
query-key heads, and a value head dim over the backward's column block (two of its steps); and
two parts chained by the final state against the whole. bf16 on a GPU is marked cuda."""

from __future__ import annotations

import pytest
import torch

from megatronish.ops import gated_delta
from tests.gated_delta_cases import assert_close, inputs, outputs_and_grads
from tests.kernel_env import kernels  # noqa: F401 (defines the kernels for the interpreter)
from tests.tolerances import BF16_GEMM

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rule(backend: str):
    def run(q, k, v, g, beta, state):
        args = [x.to(DEVICE) for x in (q, k, v, g, beta, state)]
        out, final = gated_delta.gated_delta_rule(*args, True, l2norm_qk=True, backend=backend)
        return out.cpu(), final.cpu()

    return run


def recurrent(q, k, v, g, beta, state):
    q, k = gated_delta.prepare(q, k, v, True)
    return gated_delta.recurrent(q, k, v, g, beta, q.shape[-1] ** -0.5, state)


def test_triton_matches_the_float64_recurrence_with_every_gradient():
    leaves = inputs(b=1, k_heads=1, heads=2, seq=100, dk=16, dv=64)
    reference = outputs_and_grads(recurrent, leaves)
    assert_close(outputs_and_grads(rule("triton"), leaves, torch.float32), reference)


def test_triton_on_two_parts_chained_by_the_final_state_equals_the_whole():
    leaves = inputs(b=1, k_heads=1, heads=1, seq=128, dk=16, dv=32)

    def chained(q, k, v, g, beta, state):
        out1, mid = rule("triton")(*(x[:, :, :64] for x in (q, k, v, g, beta)), state)
        out2, final = rule("triton")(*(x[:, :, 64:] for x in (q, k, v, g, beta)), mid)
        return torch.cat([out1, out2], dim=2), final

    whole = outputs_and_grads(rule("triton"), leaves, torch.float32)
    assert_close(outputs_and_grads(chained, leaves, torch.float32), whole)


def test_triton_stays_accurate_with_one_key_repeated_beta_one_and_strong_decays():
    """The worst case of the chunk's triangular system (I + A with A all ones below the
    diagonal: its inverse's series in A has terms up to C(63, 31)), and decays whose e^G
    underflows fp32 within a chunk (G ~ -300 at its end)."""
    q, k, v, g, beta, state = inputs(heads=1, seq=128, dk=16, dv=32, seed=3)
    k = k[:, :, :1].expand_as(k).clone()
    leaves = [q, k, v, 20 * g, torch.ones_like(beta), state]
    reference = outputs_and_grads(recurrent, leaves)
    assert_close(outputs_and_grads(rule("triton"), leaves, torch.float32), reference)


def test_head_dims_the_kernels_do_not_take_go_to_torch_under_auto_and_fail_under_triton():
    x = torch.zeros(1, 1, 4, 24, device=DEVICE)
    assert gated_delta.gated_delta_backend("auto", x, x) == "torch"
    with pytest.raises(ValueError, match="head dims"):
        gated_delta.gated_delta_backend("triton", x, x)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_triton_bf16_at_qwen35_head_dims_matches_the_float64_recurrence():
    leaves = inputs(b=1, k_heads=2, heads=4, seq=300, dk=128, dv=128)
    reference = outputs_and_grads(recurrent, leaves)
    assert_close(outputs_and_grads(rule("triton"), leaves, torch.bfloat16), reference, BF16_GEMM)
