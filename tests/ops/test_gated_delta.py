"""The gated delta rule's torch path (megatronish.ops.gated_delta): the chunked WY / UT form in
fp32 against the float64 recurrence (outputs, final state, every gradient, the initial state's
included), against transformers' torch_chunk_gated_delta_rule, and chained: the first part of
a sequence and then the rest from its final state give the whole's outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from megatronish.ops import gated_delta
from tests.gated_delta_cases import assert_close, inputs, outputs_and_grads


def rule(**kw):
    def run(q, k, v, g, beta, state):
        return gated_delta.gated_delta_rule(q, k, v, g, beta, state, True, **kw)

    return run


def recurrent(l2norm_qk: bool):
    def run(q, k, v, g, beta, state):
        q, k = gated_delta.prepare(q, k, v, l2norm_qk)
        return gated_delta.recurrent(q, k, v, g, beta, q.shape[-1] ** -0.5, state)

    return run


@pytest.mark.parametrize("l2norm_qk", [True, False], ids=["l2norm", "raw"])
def test_chunked_fp32_matches_the_float64_recurrence_with_gradients(l2norm_qk):
    leaves = inputs(b=2, k_heads=1, heads=2, seq=150, dk=16, dv=32)
    if not l2norm_qk:  # keys of norm ~0.5: the delta rule's contraction (beta |k|^2 < 2)
        leaves[1] = leaves[1] / (2 * leaves[1].shape[-1] ** 0.5)
    reference = outputs_and_grads(recurrent(l2norm_qk), leaves)
    ours = outputs_and_grads(rule(l2norm_qk=l2norm_qk, backend="torch"), leaves, torch.float32)
    assert_close(ours, reference)


def test_chunked_matches_transformers_torch_chunk_gated_delta_rule():
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    leaves = inputs(b=2, k_heads=2, heads=4, seq=100, dk=16, dv=32)

    def theirs(q, k, v, g, beta, state):
        t = [x.transpose(1, 2) for x in (q, k, v, g, beta)]  # [b, s, heads, ...]
        out, final = modeling.torch_chunk_gated_delta_rule(
            *t, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        return out.transpose(1, 2), final

    reference = outputs_and_grads(theirs, leaves, torch.float32)
    assert_close(outputs_and_grads(rule(l2norm_qk=True), leaves, torch.float32), reference)


@pytest.mark.parametrize("split", [64, 50], ids=["at-a-chunk", "mid-chunk"])
def test_two_parts_chained_by_the_final_state_equal_the_whole(split):
    leaves = inputs(seq=150, dk=16, dv=32)

    def chained(q, k, v, g, beta, state):
        first = [x[:, :, :split] for x in (q, k, v, g, beta)]
        rest = [x[:, :, split:] for x in (q, k, v, g, beta)]
        out1, mid = rule(l2norm_qk=True)(*first, state)
        out2, final = rule(l2norm_qk=True)(*rest, mid)
        return torch.cat([out1, out2], dim=2), final

    whole = outputs_and_grads(rule(l2norm_qk=True), leaves, torch.float32)
    assert_close(outputs_and_grads(chained, leaves, torch.float32), whole)


def test_without_an_initial_state_the_state_starts_at_zero_and_none_is_returned():
    q, k, v, g, beta, state = inputs(seq=70)
    out, final = gated_delta.gated_delta_rule(q, k, v, g, beta, None)
    assert final is None
    zero = torch.zeros_like(state)
    expected, _ = gated_delta.gated_delta_rule(q, k, v, g, beta, zero, True)
    assert torch.equal(out, expected)


def test_auto_runs_torch_on_cpu_tensors():
    x = torch.zeros(1, 1, 4, 16)
    assert gated_delta.gated_delta_backend("auto", x, x) == "torch"
