"""The Triton attention with a value head dim unlike the query-key head dim (DeepSeek's latent
attention: 192 and 128), against float64 math: the forward and every gradient, causal or not,
under grouped-query heads, document masks, a sliding window, and as a ring block whose queries
come after its keys. On CPU the kernels run under Triton's interpreter (tests/kernel_env.py),
at tiny shapes that cross several of its tiles (forward and dQ 32 x 16, dK/dV 16 x 32)."""

from __future__ import annotations

import math

import pytest
import torch

from megatronish import ops
from megatronish.config.kernel_dims import (
    TRITON_HEAD_DIMS,
    TRITON_QK_HEAD_DIMS,
    triton_attention_dims_hint,
    triton_attention_dims_ok,
)
from tests.kernel_env import kernels
from tests.kernels.test_kernels import DEVICE, as64, attention64, outputs_and_grads, randn
from tests.tolerances import KERNEL_ABS, KERNEL_REL

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py


def segments_at(seq_len: int, *breaks: int) -> torch.Tensor:
    """int32 [1, seq_len]: document 0, then one more from each break on."""
    segments = torch.zeros(1, seq_len, dtype=torch.int32, device=DEVICE)
    for start in breaks:
        segments[0, start:] += 1
    return segments


def check_against_float64(n_head, n_kv, seq_len, qk_dim, v_dim, causal, segments, window):
    """kernels.attention's output and its q, k, v gradients equal float64 attention's, within
    fp32 rounding (sums of at most 192 products, |scores| of a few units)."""
    q = randn(1, n_head, seq_len, qk_dim, seed=40)
    k = randn(1, n_kv, seq_len, qk_dim, seed=41)
    v = randn(1, n_kv, seq_len, v_dim, seed=42)
    upstream = torch.randn(1, n_head, seq_len, v_dim, generator=torch.Generator().manual_seed(43))
    args = (causal, segments, window)
    ours = outputs_and_grads(lambda *x: kernels.attention(*x, *args), [q, k, v], upstream)
    exact = outputs_and_grads(lambda *x: attention64(*x, *args), as64([q, k, v]), upstream.double())
    assert ours[0].shape == (1, n_head, seq_len, v_dim)
    for name, got, want in zip(["out", "dq", "dk", "dv"], ours, exact, strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=KERNEL_ABS, rtol=KERNEL_REL, msg=name)


@pytest.mark.parametrize(
    "n_head, n_kv, seq_len, qk_dim, v_dim, causal",
    [
        (4, 2, 40, 48, 32, True),  # d = 32 + 16 in two parts, grouped-query heads
        (2, 1, 21, 32, 16, False),  # a value dim below the query-key dim
        (2, 2, 19, 16, 32, True),  # and above it
        (1, 1, 20, 192, 128, True),  # DeepSeek-V3's: 128 + 64 and 128
    ],
)
def test_attention_with_a_value_head_dim_unlike_the_query_key_dim_matches_float64(
    n_head, n_kv, seq_len, qk_dim, v_dim, causal
):
    check_against_float64(n_head, n_kv, seq_len, qk_dim, v_dim, causal, None, None)


def test_split_head_dims_under_documents_and_a_sliding_window_match_float64():
    # Breaks at 13 and 30 and a window of 7 over 40 positions: the query blocks skip key
    # blocks of other documents and out of every window, and mask the ones both edges cross.
    check_against_float64(2, 1, 40, 48, 32, True, segments_at(40, 13, 30), 7)


def block64(q, k, v, segments, window, offset):
    """A non-causal ring block in float64: (out, natural-log lse, probabilities, scale), the
    queries `offset` positions after the keys; a row that sees no key gets out 0, lse -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    positions = torch.arange(q.shape[2], device=q.device)
    hidden = positions[:, None] + offset - positions[None, :] >= window
    hidden = hidden | (segments[0][:, None, :, None] != segments[1][:, None, None, :])
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.masked_fill(lse.isinf(), 0.0)[..., None])
    return probs @ v, lse, probs, scale


def test_a_ring_block_with_split_head_dims_and_its_queries_past_its_keys_matches_float64():
    # 40 queries 40 positions after their 40 keys, a window of 20 (query i sees keys j > i + 20
    # only: the queries from 19 on see none, o 0 and lse -inf) and documents that break at 10
    # in the queries' chunk and at 25 in the keys'. megatronish.context.blocks runs the kernels.
    from megatronish.context import blocks

    q, k, v = (
        randn(1, 2, 40, 48, seed=44),
        randn(1, 1, 40, 48, seed=45),
        randn(1, 1, 40, 32, seed=46),
    )
    dout = randn(1, 2, 40, 32, seed=47).detach()
    segments = (segments_at(40, 10), segments_at(40, 25))
    args = (False, segments, 20, 40)
    got_out, got_lse = blocks.triton_forward(q.detach(), k.detach(), v.detach(), *args)
    exact = [x.detach().double() for x in (q, k, v)]
    want_out, want_lse, probs, scale = block64(*exact, segments, 20, 40)
    assert got_out.shape == (1, 2, 40, 32) and want_lse.isinf().any() and not want_lse.isinf().all()
    assert torch.equal(got_lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(got_out.double(), want_out, atol=KERNEL_ABS, rtol=KERNEL_REL)
    seen = ~want_lse.isinf()
    torch.testing.assert_close(
        got_lse.double()[seen], want_lse[seen], atol=KERNEL_ABS, rtol=KERNEL_REL
    )

    # The backward from a ring's final output and lse (finite on every row): dv = p^T do,
    # ds = p (do v^T - rowsum(do o)) scale, dq = ds k, dk = ds^T q, summed over the group.
    lse = want_lse.masked_fill(~seen, 0.0)
    got = blocks.triton_backward(q, k, v, want_out.float(), lse.float(), dout, *args)
    dout64 = dout.double()
    dprobs = dout64 @ exact[2].transpose(-1, -2)
    dscores = probs * (dprobs - (dout64 * want_out).sum(-1, keepdim=True)) * scale
    want = (
        dscores @ exact[1],
        (dscores.transpose(-1, -2) @ exact[0]).sum(1, keepdim=True),
        (probs.transpose(-1, -2) @ dout64).sum(1, keepdim=True),
    )
    for name, a, b in zip(["dq", "dk", "dv"], got, want, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, atol=KERNEL_ABS, rtol=KERNEL_REL, msg=name)


@pytest.mark.parametrize("qk_dim, v_dim", [(24, 16), (48, 48), (112, 64), (256, 128)])
def test_head_dims_the_kernels_cannot_tile_are_refused_with_the_valid_ones(qk_dim, v_dim):
    q, v = randn(1, 2, 5, qk_dim, seed=48), randn(1, 2, 5, v_dim, seed=49)
    valid = "query-key head dims: 16, 32, 48, 64, 80, 96, 128, 144, 160, 192; value head dims: "
    with pytest.raises(ValueError, match=f"query-key {qk_dim}, value {v_dim}.*{valid}16, 32"):
        kernels.attention(q, q, v, True)


def test_the_config_checks_take_the_head_dims_the_kernels_take():
    from megatronish_kernels import attention_tiles

    assert TRITON_QK_HEAD_DIMS == attention_tiles.qk_dims()
    assert TRITON_HEAD_DIMS == attention_tiles.HEAD_DIMS
    assert triton_attention_dims_ok(192, 128) and triton_attention_dims_ok(64, 64)
    assert not triton_attention_dims_ok(192, 192)  # values need a power of two
    assert not triton_attention_dims_ok(24, 16)  # a rest of 8 is below a dot's depth
    assert triton_attention_dims_hint() == (
        "valid query-key head dims: 16, 32, 48, 64, 80, 96, 128, 144, 160, 192; "
        "valid value head dims: 16, 32, 64, 128"
    )


def test_auto_backend_runs_attention_on_torch_for_head_dims_the_kernels_cannot_take(
    monkeypatch,
):
    monkeypatch.setattr(ops, "resolve_backend", lambda backend, x: "triton")  # as on a GPU
    called = []
    fake = type("Kernels", (), {"attention": staticmethod(lambda *a, **k: called.append(a))})
    monkeypatch.setattr(ops, "_kernels", lambda: fake)
    q, v = torch.randn(1, 2, 4, 192), torch.randn(1, 2, 4, 192)
    torch.testing.assert_close(ops.attention(q, q, v), ops.reference.attention(q, q, v, True))
    assert called == [] and ops.attention_backend("triton", q, v) == "triton"
    ops.attention(q, q, torch.randn(1, 2, 4, 128))
    assert len(called) == 1  # 192 with 128 runs on the kernels
