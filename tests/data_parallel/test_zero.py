"""ZeRO-1 over the gradient buffer (Megatron's distributed optimizer): at dp = 3, where the
buckets need padding and parameters straddle the ranks' blocks, the blocks tile every
parameter exactly once, each rank keeps AdamW state for its blocks only, the parameter
all-gathers are still in flight when a step ends (the next forward waits for them), the losses
and gradient norms equal one process, and a checkpoint (whole-parameter state, gathered from
the blocks) resumes bitwise at its own layout and on the same curve at dp = 1. The dp = 3 ranks
use plain gloo; the shared-memory reduce-scatter and gather are the other ZeRO-1 tests'."""

from __future__ import annotations

import pytest

from tests.parity import GPT2, make_config, make_trainer
from tests.ranks import run_on_ranks
from tests.tolerances import LAYOUT_CURVE_REL

STEPS, SAVED_AT = 6, 3
# d_model 32 at dp 3: no bucket is a multiple of 3 by chance; 10 kB buckets: many of them.
COMMON = GPT2 + ["train.global_batch_size=6", "optim.bucket_mb=0.01"]


def _config(dp: int, zero: int, dataset, ckpt_dir, resume: str = "never"):
    extra = [
        f"train.steps={STEPS}",
        f"optim.zero={zero}",
        "checkpoint.save=true",
        f"checkpoint.dir={ckpt_dir}",
        f"checkpoint.resume={resume}",
    ]
    return make_config(1, dp, 1, COMMON, dataset, extra)


def _run(trainer, steps: int, save_at: int | None = None) -> list[tuple[float, float]]:
    out = []
    for _ in range(steps):
        result = trainer.train_step()
        out.append((result.loss, result.grad_norm))
        if trainer.step == save_at:
            trainer.save_checkpoint()
    return out


def _dp3(rank, world, dataset, ckpt_dir):
    import os

    os.environ["MEGATRONISH_SHM"] = "0"  # gloo: asynchronous gathers (shared memory: the others)
    trainer = make_trainer(_config(3, 1, dataset, ckpt_dir), world, dataset)
    dp = trainer.data_parallel
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    facts = {
        "buckets": [(b.stop - b.start, sum(p.numel() for p in b.params)) for b in dp.buckets],
        "pieces": [(names[id(pc.param)], pc.lo, pc.data.numel()) for pc in dp.pieces],
        "sizes": {n: p.numel() for n, p in trainer.model.named_parameters()},
        # AdamW's moments: the tensors allocated, and the pieces' views of them
        "allocated": sum(t.numel() for moments in dp.shard_state for t in moments.values()),
        "viewed": sum(
            t.numel() for st in dp.update.state.values() for k, t in st.items() if k != "step"
        ),
        "whole": [n for n, p in trainer.model.named_parameters() if p in dp.update.state],
        "blocks": sum(b.grad_shard.numel() for b in dp.buckets),
        "grad_is_none": all(p.grad is None for p in dp.params),
    }
    facts["curve"] = _run(trainer, 1)
    # the step ends with every bucket's parameter all-gather in flight (the next forward's
    # pre-hooks wait for them)
    facts["in_flight"] = sum(b.gather is not None for b in dp.buckets) == len(dp.buckets)
    facts["curve"] += _run(trainer, STEPS - 1, save_at=SAVED_AT)
    resume = str(ckpt_dir / f"step_{SAVED_AT:06d}")
    again = make_trainer(_config(3, 1, dataset, ckpt_dir / "again", resume), world, dataset)
    facts["resumed"] = _run(again, STEPS - SAVED_AT)
    return facts


def _dp1(rank, world, dataset, ckpt_dir):
    whole = _run(make_trainer(_config(1, 0, dataset, ckpt_dir / "one"), world, dataset), STEPS)
    resume = str(ckpt_dir / f"step_{SAVED_AT:06d}")
    cfg = _config(1, 0, dataset, ckpt_dir / "one-resumed", resume)
    return {"curve": whole, "resumed": _run(make_trainer(cfg, world, dataset), STEPS - SAVED_AT)}


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("zero1")
    dp3 = run_on_ranks(_dp3, 3, dataset, ckpt_dir, timeout=240)
    (dp1,) = run_on_ranks(_dp1, 1, dataset, ckpt_dir, timeout=240)
    return dp3, dp1


def test_zero1_blocks_tile_every_parameter_once_and_buckets_pad_to_the_group(runs):
    dp3, _ = runs
    facts = dp3[0]
    assert len(facts["buckets"]) > 3
    for padded, content in facts["buckets"]:
        assert padded % 3 == 0 and padded - content == -content % 3
    assert any(padded != content for padded, content in facts["buckets"])
    covered: dict[str, list[tuple[int, int]]] = {}
    for rank in dp3:
        for name, lo, n in rank["pieces"]:
            covered.setdefault(name, []).append((lo, lo + n))
    assert covered.keys() == facts["sizes"].keys()
    straddling = 0
    for name, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == facts["sizes"][name], name
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name  # no gap, no overlap
        straddling += len(spans) > 1
    assert straddling > 0


def test_zero1_keeps_adamw_state_for_this_ranks_blocks_only(runs):
    dp3, _ = runs
    total = sum(dp3[0]["sizes"].values())
    for rank in dp3:
        assert rank["allocated"] == 2 * rank["blocks"]  # exp_avg and exp_avg_sq of the blocks
        assert rank["viewed"] == 2 * sum(n for _, _, n in rank["pieces"])
        assert rank["whole"] == []  # every parameter is in the buffer here
        assert rank["blocks"] * 3 == sum(padded for padded, _ in rank["buckets"])
        assert rank["blocks"] < total / 3 + 3 * len(rank["buckets"])
        assert rank["grad_is_none"]  # the reduced gradient lives only in the blocks
        assert rank["in_flight"]


def test_zero1_at_dp3_losses_and_grad_norms_equal_one_process(runs):
    dp3, dp1 = runs
    want = [x for pair in dp1["curve"] for x in pair]
    assert dp1["curve"][-1][0] < dp1["curve"][0][0]
    for rank in dp3:
        assert rank["curve"] == dp3[0]["curve"]
        assert [x for pair in rank["curve"] for x in pair] == pytest.approx(
            want, rel=LAYOUT_CURVE_REL
        )


def test_zero1_checkpoint_resumes_bitwise_at_dp3_and_on_the_curve_at_dp1(runs):
    dp3, dp1 = runs
    after = dp3[0]["curve"][SAVED_AT:]
    for rank in dp3:
        assert rank["resumed"] == after
    got = [x for pair in dp1["resumed"] for x in pair]
    assert got == pytest.approx([x for pair in after for x in pair], rel=LAYOUT_CURVE_REL)
