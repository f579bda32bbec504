"""The Triton attention kernels with a softmax scale, logit soft-capping and attention sinks
(forward, and the gradients of q, k, v and the sinks) against float64 torch, under Triton's
interpreter on CPU (tests/kernel_env.py), with a sliding window, document masks and grouped-query
heads at once."""

from __future__ import annotations

import pytest
import torch

from megatronish import ops
from megatronish.ops import reference
from tests.kernel_env import kernels
from tests.tolerances import KERNEL_ABS, KERNEL_REL

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQ = 40  # over the interpreter's tiles (forward and dQ 32 x 16, dK/dV 16 x 32)


def _tensor(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _segments() -> torch.Tensor:
    segments = torch.zeros(1, SEQ, dtype=torch.int32)
    segments[0, 13:], segments[0, 30:] = 1, 2
    return segments.to(DEVICE)


# (scale, softcap, with sinks): the scores' scale (None: 1/sqrt(d)); a soft-cap of 2 against
# scores of about 2 (q drawn at twice the unit scale), so most scores are bent by the cap.
CASES = {
    "sinks": (None, None, True),
    "softcap": (None, 2.0, False),
    "scale softcap sinks": (0.4, 2.0, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_kernels_with_sinks_and_softcap_match_float64_forward_and_every_gradient(case):
    scale, softcap, with_sinks = CASES[case]
    # Two kv heads for four query heads; a window of 7 and three documents (breaks at 13, 30).
    inputs64 = [
        _tensor(1, 4, SEQ, 16, seed=20, scale=2.0),
        _tensor(1, 2, SEQ, 16, seed=21),
        _tensor(1, 2, SEQ, 16, seed=22),
        _tensor(4, seed=23) if with_sinks else None,
    ]
    upstream = _tensor(1, 4, SEQ, 16, seed=99)
    leaves = [None if x is None else x.to(DEVICE).requires_grad_(True) for x in inputs64]
    ours = [None if x is None else x.detach().float().requires_grad_(True) for x in leaves]
    options = dict(scale=scale, softcap=softcap)

    want = reference.attention(*leaves[:3], True, _segments(), 7, sinks=leaves[3], **options)
    got = kernels.attention(*ours[:3], True, _segments(), 7, sinks=ours[3], **options)
    want.backward(upstream.to(DEVICE))
    got.backward(upstream.float().to(DEVICE))
    torch.testing.assert_close(got.double(), want.detach(), atol=KERNEL_ABS, rtol=KERNEL_REL)
    for name, a, b in zip(["dq", "dk", "dv", "dsinks"], ours, leaves, strict=True):
        if a is not None:
            assert a.grad.dtype == a.dtype, name
            torch.testing.assert_close(
                a.grad.double(), b.grad, atol=KERNEL_ABS, rtol=KERNEL_REL, msg=name
            )
    with torch.no_grad():  # megatronish.ops hands every option to the kernels
        dispatched = ops.attention(
            *ours[:3], True, "triton", _segments(), 7, sinks=ours[3], **options
        )
        assert torch.equal(dispatched, got)


def test_attention_kernels_reject_a_soft_cap_not_above_zero_and_sinks_not_one_per_head():
    q, k, v = (_tensor(1, 2, 16, 16, seed=s).float().to(DEVICE) for s in (1, 2, 3))
    with pytest.raises(ValueError, match="soft-cap must be > 0, got 0.0"):
        kernels.attention(q, k, v, True, softcap=0.0)
    with pytest.raises(ValueError, match=r"sinks must be \[n_head\] = \[2\], got \[3\]"):
        kernels.attention(q, k, v, True, sinks=torch.zeros(3, device=DEVICE))
