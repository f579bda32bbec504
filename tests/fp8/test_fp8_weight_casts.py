"""The weights' fp8 casts are taken once per optimizer step (megatronish.fp8.gemm keeps them
until the trainer's weights_changed): a step of several micro-batches casts each weight once
per use (forward, input gradient), its amax all-reduces are once a step (the bench's counted
bytes hold the formula to that at tp 2), and the losses equal those of casting every time."""

from __future__ import annotations

import pytest

from megatronish.accounting.collectives import collectives_per_step
from megatronish.config import derive, load_config
from megatronish.fp8 import RECIPES, gemm

TINY = [
    "model.arch=llama",
    "model.n_kv_head=2",
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=4",
    "model.max_seq_len=16",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=6",
    "train.eval_every=0",
    "checkpoint.save=false",
    "train.precision=fp8",
    "train.fp8_high_precision=fp32",
]


def _losses(dataset, monkeypatch, recipe: str, keep: bool) -> tuple[list[float], int]:
    """Three steps' losses, and the weight casts made (keep False: every time)."""
    from megatronish.data.sources import run_data
    from megatronish.distributed.layout import ParallelState
    from megatronish.training.setup import Setup
    from megatronish.training.trainer import Trainer

    made, quantize, weight = [0], gemm.quantize, RECIPES[recipe].weight

    def counted(casts, power_of_2, split, backend):
        if not keep:
            gemm.weights_changed()
        made[0] += sum(cast.operand is weight for cast in casts)
        return quantize(casts, power_of_2, split, backend)

    monkeypatch.setattr(gemm, "quantize", counted)
    sets = [*TINY, f"train.fp8_recipe={recipe}", f"data.path={dataset}"]
    cfg, data = run_data(load_config(None, sets))
    derived = derive(cfg, 1, vocab_size=data.vocab_size)
    trainer = Trainer(Setup(cfg, derived, ParallelState.single(), data))
    return [trainer.train_step().loss for _ in range(3)], made[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_weights_are_cast_once_a_step_with_the_losses_of_casting_every_time(
    dataset, monkeypatch, recipe
):
    kept, once = _losses(dataset, monkeypatch, recipe, keep=True)
    every, each_time = _losses(dataset, monkeypatch, recipe, keep=False)
    assert kept == every
    # 2 blocks x (qkv, proj, gate, up, down), forward and input gradient, 3 steps (rowwise:
    # qkv's input-gradient cast is one per q, k and v); 3 micro-batches a step cast them
    # three times as often without the kept casts.
    per_block = 5 * 2 + (2 if recipe == "rowwise" else 0)
    assert once == 2 * per_block * 3
    assert each_time == 3 * once


def test_the_weight_amaxes_are_all_reduced_once_a_step_whatever_the_micro_batches():
    def weight_calls(batch: int) -> dict[str, int]:
        sets = [*TINY, "parallel.tp=2", f"train.global_batch_size={batch}"]
        cfg = load_config(None, sets)
        ops = collectives_per_step(cfg, derive(cfg, 2, vocab_size=257))
        return {op.what: op.count for op in ops if op.what.endswith("with the weight's")}

    assert weight_calls(2) == weight_calls(8) != {}
    assert sum(weight_calls(8).values()) == 2 * 5  # one a weight (tensorwise: in the forward)
