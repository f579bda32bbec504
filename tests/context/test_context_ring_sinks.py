"""Ring attention with a softmax scale, logit soft-capping and attention sinks, under a sliding
window and documents that span cp ranks, at cp 2 on gloo: forward and every gradient (the
sinks' too) equal one process's float64 attention, on torch blocks and on Triton's flash blocks
under the interpreter; each sink joins a query's denominator once, and none travel."""

from __future__ import annotations

import pytest
import torch

from megatronish.context.zigzag import shard_sequence, unshard_sequence
from tests.context.test_context_ring import HEAD_DIM, N_HEAD, N_KV, WINDOW, _documents, _inputs
from tests.ranks import run_on_ranks
from tests.tolerances import EXACT, FP32_RING_ABS

CP, BATCH = 2, 1
# A soft-cap of 2 against scores of about 2 (q at twice the unit scale): most are bent by it.
OPTIONS = dict(scale=0.4, softcap=2.0)


def _leaves():
    """q (twice the unit scale), k, v, the output gradient and the sinks [N_HEAD], float64."""
    q, k, v, dout = _inputs(CP, torch.float64, BATCH)
    sinks = torch.randn(N_HEAD, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return [2 * q, k, v, dout, sinks]


def _ring_rank(rank, world, backends):
    from megatronish.context import Ring, ring_attention
    from megatronish.distributed import comm
    from megatronish.distributed.layout import ParallelState

    ring = Ring.of(ParallelState.from_world(1, 1, 1, cp=world))
    *qkv_dout, sinks = _leaves()
    q, k, v, dout = (shard_sequence(x, world, rank, 2) for x in qkv_dout)
    shards = _documents(world, BATCH).shard(world, rank).shards
    results = {}
    for backend in backends:
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
        with comm.CommCounter() as counter:
            out = ring_attention(
                *leaves[:3], ring, backend, shards, WINDOW, sinks=leaves[3], **OPTIONS
            )
            out.backward(dout)
        results[backend] = [out.detach()] + [x.grad for x in leaves]
        results[f"{backend} sent"] = dict(counter.sent_bytes)
    return results


def _one_process():
    from megatronish.ops import reference

    q, k, v, dout, sinks = _leaves()
    q, k, v, sinks = (x.requires_grad_(True) for x in (q, k, v, sinks))
    segments = _documents(CP, BATCH).segments
    out = reference.attention(q, k, v, True, segments, WINDOW, sinks=sinks, **OPTIONS)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad, sinks.grad]


@pytest.fixture(scope="module")
def ring_results():
    """Every rank's results, one run for every test here; the ranks run the Triton blocks
    under the interpreter (CPU tensors)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return run_on_ranks(_ring_rank, CP, ["torch", "triton"], timeout=120)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ring_with_sinks_and_softcap_equals_one_process_forward_and_every_gradient(
    backend, ring_results
):
    want = _one_process()
    for index, name in enumerate(["out", "dq", "dk", "dv"]):
        got = unshard_sequence([r[backend][index] for r in ring_results], dim=2)
        torch.testing.assert_close(got, want[index], rtol=EXACT, atol=FP32_RING_ABS, msg=name)
    # Each rank's sink gradient covers its own queries; summed over cp they are the whole's.
    dsinks = sum(r[backend][4] for r in ring_results)
    torch.testing.assert_close(dsinks, want[4], rtol=EXACT, atol=FP32_RING_ABS, msg="dsinks")


def test_the_ring_sends_no_sinks_only_keys_values_and_their_gradients(ring_results):
    # As without sinks: cp - 1 hops of k and v forward, as many backward and cp hops of their
    # float64 gradient accumulator.
    local = BATCH * N_KV * 6 * HEAD_DIM * 8  # one of k or v on a rank, float64
    want = 2 * local * (CP - 1) * 2 + 2 * local * CP
    for result in ring_results:
        assert result["torch sent"] == result["triton sent"] == {"cp_ring": want}
