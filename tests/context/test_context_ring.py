"""Ring attention alone: on its zigzag shards it equals full causal attention, forward and
every gradient, in float64 (torch blocks) and under Triton's interpreter (flash blocks), also
under document masks with documents that span chunks and cp ranks, and under a sliding window
(by global position; blocks wholly outside it are not computed, their keys still travel) with
and without documents, and with a softmax scale, soft-capped scores and attention sinks (each
joining a query's denominator once; their gradient too); only the kv heads travel (grouped-query
attention; no sinks), the ring sends exactly the analytic bytes, and every cp rank scores the
same number of query-key pairs."""

from __future__ import annotations

import pytest
import torch

from megatronish.context.zigzag import (
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
)
from tests.ranks import run_on_ranks
from tests.tolerances import BF16_RING_ABS, EXACT, FP32_RING_ABS

B, N_HEAD, N_KV, HEAD_DIM = 2, 4, 2, 16


def _batch(cp: int, backend: str) -> int:
    """Sequences a run takes: B, except the Triton blocks at cp 4, interpreted, on the first
    sequence alone (the one whose documents span ranks; the interpreter's time is per program,
    and cp 2 holds the batch of two)."""
    return 1 if (backend, cp) == ("triton", 4) else B


def _inputs(cp: int, dtype: torch.dtype, batch: int = B):
    gen = torch.Generator().manual_seed(cp)
    s = 6 * cp  # chunks of 3 tokens: odd sizes
    q = torch.randn(B, N_HEAD, s, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(B, N_KV, s, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(B, N_KV, s, HEAD_DIM, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, N_HEAD, s, HEAD_DIM, generator=gen, dtype=torch.float64)
    return [x[:batch].to(dtype) for x in (q, k, v, dout)]


def _documents(cp: int, batch: int = B):
    """The documents of the two sequences: five in the first (ends at 1, 3 cp, 3 cp + 1 and
    5 cp: two span chunks and ranks), one in the second (the first `batch` of them)."""
    from megatronish.context import documents_of

    tokens = torch.ones(B, 6 * cp, dtype=torch.long)
    tokens[0, [1, 3 * cp, 3 * cp + 1, 5 * cp]] = 0
    return documents_of(tokens[:batch], 0)


WINDOW = 4  # chunks of 3: some blocks partly inside, the farther ones wholly outside
# (documents, sliding window) of each variant a ring run computes
VARIANTS = {
    "grads": (False, None),
    "documents": (True, None),
    "window": (False, WINDOW),
    "window documents": (True, WINDOW),
    "scores": (True, WINDOW),  # and SCORES, with sinks
}
# The "scores" variant's options: a soft-cap of 2 against scores of about 2 (q at twice the
# unit scale there), so most scores are bent by it; and the sinks of _sinks().
SCORES = dict(scale=0.4, softcap=2.0)


def _sinks() -> torch.Tensor:
    return torch.randn(N_HEAD, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _ring_rank(rank, world, backend, dtype, variants):
    from megatronish.context import Ring, RingCounter, ring_attention
    from megatronish.distributed import comm
    from megatronish.distributed.layout import ParallelState

    ps = ParallelState.from_world(1, 1, 1, cp=world)
    batch = _batch(world, backend)
    inputs = _inputs(world, dtype, batch)
    q, k, v, dout = (shard_sequence(x, world, rank, 2) for x in inputs)
    results = {}
    for name in variants:
        masked, window = VARIANTS[name]
        shards = _documents(world, batch).shard(world, rank).shards if masked else None
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        options = {}
        if name == "scores":
            leaves[0] = (2 * q).requires_grad_(True)
            leaves.append(_sinks().requires_grad_(True))
            options = dict(SCORES, sinks=leaves[3])
        with comm.CommCounter() as counter, RingCounter() as work:
            out = ring_attention(*leaves[:3], Ring.of(ps), backend, shards, window, **options)
            out.backward(dout)
        results[name] = [out.detach()] + [x.grad for x in leaves]
        results[f"{name} sent"], results[f"{name} pairs"] = dict(counter.sent_bytes), work.pairs
    return results


def _full_causal(cp: int, masked: bool = False, window: int | None = None, batch: int = B):
    from megatronish.ops import reference

    q, k, v, dout = (x.clone() for x in _inputs(cp, torch.float64, batch))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    segments = _documents(cp, batch).segments if masked else None
    out = reference.attention(q, k, v, causal=True, segments=segments, window=window)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _full_scores(cp: int, batch: int):
    """The "scores" variant in one process: out, dq, dk, dv and dsinks, float64."""
    from megatronish.ops import reference

    q, k, v, dout = _inputs(cp, torch.float64, batch)
    q, k, v, sinks = ((2 * q), k, v, _sinks())
    q, k, v, sinks = (x.requires_grad_(True) for x in (q, k, v, sinks))
    segments = _documents(cp, batch).segments
    out = reference.attention(q, k, v, True, segments, WINDOW, sinks=sinks, **SCORES)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad, sinks.grad]


_RUNS: dict = {}


def ring_run(cp: int, backend: str = "torch"):
    """Every rank's results of the variants: all of them on torch blocks; under the
    interpreter (slow) those without a window (the Triton blocks under a window are
    tests/kernels/test_kernels.py's)."""
    key = (cp, backend)
    if key not in _RUNS:
        variants = list(VARIANTS)
        if backend == "triton":
            variants = ["grads", "documents"] + (["scores"] if cp == 2 else [])
        _RUNS[key] = run_on_ranks(_ring_rank, cp, backend, torch.float64, variants, timeout=120)
    return _RUNS[key]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_forward_and_every_gradient_equal_full_causal_attention_float64(cp):
    per_rank = ring_run(cp)
    want = _full_causal(cp)
    for index, name in enumerate(["out", "dq", "dk", "dv"]):
        got = unshard_sequence([r["grads"][index] for r in per_rank], dim=2)
        torch.testing.assert_close(got, want[index], rtol=EXACT, atol=FP32_RING_ABS, msg=name)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_under_a_sliding_window_equals_full_windowed_attention_float64(
    cp, documents
):
    per_rank = ring_run(cp)
    variant = "window documents" if documents else "window"
    want = _full_causal(cp, documents, WINDOW)
    for index, name in enumerate(["out", "dq", "dk", "dv"]):
        got = unshard_sequence([r[variant][index] for r in per_rank], dim=2)
        torch.testing.assert_close(got, want[index], rtol=EXACT, atol=FP32_RING_ABS, msg=name)


@pytest.mark.parametrize("cp", [2, 4])
def test_under_a_sliding_window_the_ring_scores_only_the_pairs_within_it_and_sends_as_much(cp):
    per_rank = ring_run(cp)
    s = 6 * cp
    window_pairs = sum(min(i + 1, WINDOW) for i in range(s))  # query i sees min(i + 1, W) keys
    assert sum(r["window pairs"] for r in per_rank) == B * N_HEAD * window_pairs
    for result in per_rank:  # the blocks outside the window are skipped; every hop still runs
        assert result["window sent"] == result["grads sent"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_sends_only_the_kv_heads_the_analytic_count_gives(cp):
    # Forward: cp - 1 hops of k and v; backward: cp - 1 hops of k and v and cp hops of their
    # fp32 (here fp64) gradient accumulator. Only the N_KV heads travel, not N_HEAD.
    local = B * N_KV * (6 * cp // cp) * HEAD_DIM * 8  # one of k or v, float64
    want = 2 * local * (cp - 1) * 2 + 2 * local * cp
    for result in ring_run(cp):
        assert result["grads sent"] == {"cp_ring": want}


@pytest.mark.parametrize("cp", [2, 4])
def test_every_cp_rank_scores_the_same_query_key_pairs(cp):
    pairs = [r["grads pairs"] for r in ring_run(cp)]
    assert len(set(pairs)) == 1
    # The forward blocks of all ranks together score the causal triangle of the full sequence.
    s = 6 * cp
    assert sum(pairs) == B * N_HEAD * s * (s + 1) // 2


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_with_a_scale_softcap_and_sinks_equals_one_process_with_every_gradient_float64(cp):
    # Under a window and documents that span ranks; each rank's sink gradient covers its own
    # queries, and summed over cp they are the whole sequence's.
    per_rank = ring_run(cp)
    want = _full_scores(cp, B)
    for index, name in enumerate(["out", "dq", "dk", "dv"]):
        got = unshard_sequence([r["scores"][index] for r in per_rank], dim=2)
        torch.testing.assert_close(got, want[index], rtol=EXACT, atol=FP32_RING_ABS, msg=name)
    dsinks = sum(r["scores"][4] for r in per_rank)
    torch.testing.assert_close(dsinks, want[4], rtol=EXACT, atol=FP32_RING_ABS, msg="dsinks")
    for result in per_rank:  # the sinks do not travel: the same bytes as without them
        assert result["scores sent"] == result["grads sent"]


@pytest.mark.slow  # Triton flash blocks under the interpreter
def test_ring_with_a_scale_softcap_and_sinks_on_triton_flash_blocks_equals_one_process(
    monkeypatch,
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    per_rank = ring_run(2, "triton")
    want = _full_scores(2, _batch(2, "triton"))
    for index, name in enumerate(["out", "dq", "dk", "dv", "dsinks"]):
        got = [r["scores"][index] for r in per_rank]
        got = sum(got) if name == "dsinks" else unshard_sequence(got, dim=2)
        torch.testing.assert_close(got, want[index], rtol=EXACT, atol=FP32_RING_ABS, msg=name)


def test_zigzag_shards_hold_chunks_r_and_2cp_minus_1_minus_r_at_their_global_positions():
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 4, 1).tolist() == [[2, 3, 12, 13]]
    assert zigzag_positions(4, 4, 1).tolist() == [2, 3, 12, 13]
    shards = [shard_sequence(x, 4, r) for r in range(4)]
    assert torch.equal(unshard_sequence(shards), x)


@pytest.mark.slow  # Triton flash blocks under the interpreter
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_on_triton_flash_blocks_equals_full_causal_attention(cp, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU: the kernels run under the interpreter
    per_rank = ring_run(cp, "triton")
    want = _full_causal(cp, batch=_batch(cp, "triton"))
    for index, name in enumerate(["out", "dq", "dk", "dv"]):
        got = unshard_sequence([r["grads"][index] for r in per_rank], dim=2)
        torch.testing.assert_close(got, want[index], rtol=EXACT, atol=FP32_RING_ABS, msg=name)


@pytest.mark.slow  # Triton flash blocks under the interpreter at cp 4
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ring_attention_over_documents_spanning_cp_ranks_equals_masked_full_attention(
    backend, cp, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    per_rank = ring_run(cp, backend)
    want = _full_causal(cp, masked=True, batch=_batch(cp, backend))
    for index, name in enumerate(["out", "dq", "dk", "dv"]):
        got = unshard_sequence([r["documents"][index] for r in per_rank], dim=2)
        torch.testing.assert_close(got, want[index], rtol=EXACT, atol=FP32_RING_ABS, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_flash_blocks_on_cuda_match_the_float64_blocks(causal):
    from megatronish.context.blocks import (
        torch_backward,
        torch_forward,
        triton_backward,
        triton_forward,
    )

    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (
        torch.randn(2, n, 200, 64, generator=gen, dtype=torch.float64) for n in (8, 2, 2, 8)
    )
    want_out, want_lse = torch_forward(q, k, v, causal)
    want = torch_backward(q, k, v, want_out, want_lse, dout, causal)
    cuda = [x.to("cuda", torch.bfloat16) for x in (q, k, v, dout)]
    out, lse = triton_forward(*cuda[:3], causal)
    got = triton_backward(*cuda[:3], want_out.to("cuda"), want_lse.to("cuda"), cuda[3], causal)
    torch.testing.assert_close(out.double().cpu(), want_out, rtol=EXACT, atol=BF16_RING_ABS)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=EXACT, atol=BF16_RING_ABS)
    for name, g, w in zip(["dq", "dk", "dv"], got, want):
        scale = w.abs().max().item()
        torch.testing.assert_close(
            g.double().cpu() / scale, w / scale, rtol=EXACT, atol=BF16_RING_ABS, msg=name
        )
