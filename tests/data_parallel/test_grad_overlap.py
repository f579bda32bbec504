"""Gradient reduction from a contiguous buffer, overlapped with backward: at dp2, dp2 x tp2
(sequence parallel) and dp2 x pp2 (tied embeddings across stages), the losses and gradient
norms are bitwise those of the unbuffered reduction (data_parallel.outside over every
gradient), with the overlap on and off, and with buckets small enough that every layer has
its own. With ZeRO-1 (dp2, and dp2 x tp2 with sequence parallelism, whose replicated
parameters stay outside the buffer) the sharded buffer holds 1e-6 of whole-parameter ZeRO-1
over the unbuffered reduction, bitwise the same with the overlap on and off."""

from __future__ import annotations

import pytest

from tests.parity import GPT2, LAYOUT_STEPS, LLAMA, SP, make_config, make_trainer
from tests.ranks import run_on_ranks
from tests.tolerances import EXACT, ZERO_CURVE_REL

pytestmark = pytest.mark.slow  # multi-rank training with and without the overlap

SMALL_BUCKETS = "optim.bucket_mb=0.01"  # 10 kB: many buckets
TWO = {"gpt2 dp2": (1, 2, 1, GPT2), "llama dp2 zero1": (1, 2, 1, LLAMA + ["optim.zero=1"])}
FOUR = {
    "gpt2 dp2 tp2 sp": (2, 2, 1, GPT2 + SP),
    "gpt2 dp2 pp2": (1, 2, 2, GPT2),
    "gpt2 dp2 tp2 sp pp1 zero1": (2, 2, 1, GPT2 + SP + ["optim.zero=1"]),
}
WAYS = {
    "unbuffered": [],
    "buffer, overlap off": ["optim.overlap_grad_reduce=false", SMALL_BUCKETS],
    "buffer, overlap on": [SMALL_BUCKETS],
}


def _curves(rank, world, variants, dataset):
    from megatronish.data_parallel import data_parallel_for

    out = {}
    for name, (tp, dp, pp, overrides) in variants.items():
        for way, sets in WAYS.items():
            short = [f"train.steps={LAYOUT_STEPS}"]
            cfg = make_config(tp, dp, pp, overrides + sets, dataset, short)
            trainer = make_trainer(cfg, world, dataset)
            if way == "unbuffered":  # every gradient through data_parallel.outside
                trainer.data_parallel.close()
                # ZeRO-1 owning whole parameters (each owner broadcasts its updated ones)
                unbuffered = data_parallel_for(trainer.model, cfg, trainer.ps, buckets=False)
                trainer.data_parallel = unbuffered
            else:
                assert len(trainer.data_parallel.buckets) > 3
            steps = [trainer.train_step() for _ in range(LAYOUT_STEPS)]
            out[(name, way)] = [(s.loss, s.grad_norm) for s in steps]
    return out


@pytest.fixture(scope="module")
def curves(dataset):
    """Per world size, every rank's curves."""
    return {
        2: run_on_ranks(_curves, 2, TWO, dataset, timeout=180),
        4: run_on_ranks(_curves, 4, FOUR, dataset, timeout=180),
    }


@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_buffered_reduction_overlapped_or_not_is_bitwise_the_unbuffered_one(name, curves):
    """Under ZeRO-1 the buffer reduce-scatters and each rank updates its blocks of the buckets,
    so a parameter's gradient norm is summed from pieces: the norms (and through clipping the
    losses) hold 1e-6 of whole-parameter ZeRO-1, and the overlap changes no bit."""
    per_rank = curves[2 if name in TWO else 4]
    want = per_rank[0][(name, "unbuffered")]
    assert want[-1][0] < want[0][0]  # it learns
    for results in per_rank:
        if "zero1" in name:
            on, off = results[(name, "buffer, overlap on")], results[(name, "buffer, overlap off")]
            assert on == off
            flat = [x for pair in on for x in pair]
            assert flat == pytest.approx(
                [x for pair in want for x in pair], rel=ZERO_CURVE_REL, abs=EXACT
            )
            assert results[(name, "unbuffered")] == want
            continue
        for way in WAYS:
            assert results[(name, way)] == want, way
