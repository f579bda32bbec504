"""The torch reference attention (megatronish.ops.reference) under a sliding window, with and
without document masks and grouped-query heads, equals the softmax written out query by query
in float64 from the definition: the query at i attends to the keys j of its document with
i - W < j <= i."""

from __future__ import annotations

import math

import pytest
import torch

from megatronish.ops import reference
from tests.tolerances import EXACT, FP64_REORDER


def _by_definition(q, k, v, segments, window):
    """out [b, n, s, d]: each query's softmax over the keys it sees, one query at a time."""
    b, n, s, d = q.shape
    group = n // k.shape[1]
    out = torch.zeros_like(q)
    for batch in range(b):
        for head in range(n):
            for i in range(s):
                seen = [
                    j
                    for j in range(s)
                    if j <= i
                    and (window is None or i - j < window)
                    and (segments is None or segments[batch, j] == segments[batch, i])
                ]
                keys, values = k[batch, head // group, seen], v[batch, head // group, seen]
                weights = torch.softmax(keys @ q[batch, head, i] / math.sqrt(d), dim=0)
                out[batch, head, i] = weights @ values
    return out


@pytest.mark.parametrize("window", [1, 4, 11])
@pytest.mark.parametrize("documents", [False, True])
def test_reference_attention_under_a_sliding_window_equals_the_definition(window, documents):
    gen = torch.Generator().manual_seed(window)
    q = torch.randn(2, 4, 11, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 11, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    segments = None
    if documents:  # documents of 3, 5 and 3 tokens in the first sequence, one in the second
        segments = torch.tensor([[0] * 3 + [1] * 5 + [2] * 3, [0] * 11], dtype=torch.int32)
    got = reference.attention(q, k, v, True, segments, window)
    torch.testing.assert_close(
        got, _by_definition(q, k, v, segments, window), rtol=EXACT, atol=FP64_REORDER
    )
    if window == 11 and not documents:  # a window as long as the sequence: plain causal
        torch.testing.assert_close(
            got, reference.attention(q, k, v, True), rtol=EXACT, atol=FP64_REORDER
        )
