"""The objectives (megatronish.objectives): a step's batch split into named micro-batches, and
next-token prediction's loss-mask divisors (the main targets' and each depth's)."""

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.context import documents_of
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.model.mtp import future_tokens_of
from megatronish.objectives.batch import MicroBatch, micro_batches
from megatronish.objectives.registry import objective_for
from tests.tolerances import FP32_FEW_OPS_REL

VOCAB, SEQ = 53, 12


def _tokens(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(3))


def test_each_micro_batch_carries_its_own_documents_and_future_tokens_and_the_steps_divisor():
    sequences = _tokens((3, 2, SEQ + 1))  # [accum, micro, s + 1]
    inputs, targets = sequences[..., :-1], sequences[..., 1:]
    documents = documents_of(inputs, eod_id=0)
    future = future_tokens_of(inputs, targets, 2)  # [accum, micro, 2, D, s]
    divisor = torch.tensor(5.0)
    batch = micro_batches(inputs, targets, divisor, documents, future)
    assert len(batch) == 3
    for index, micro in enumerate(batch):
        assert torch.equal(micro.tokens, inputs[index])
        assert torch.equal(micro.targets, targets[index])
        assert micro.divisor is divisor
        assert torch.equal(micro.documents.positions, documents[index].positions)
        assert torch.equal(micro.future_tokens, future[index])
    bare = micro_batches(inputs, targets)[0]
    assert (bare.divisor, bare.documents, bare.future_tokens) == (None, None, None)


def test_a_loss_mask_divides_the_main_and_each_depths_sum_by_its_own_divisor():
    sets = ["model.arch=llama", "model.n_layer=1", "model.n_head=4", "model.n_kv_head=2"]
    sets += ["model.d_model=32", f"model.vocab_size={VOCAB}", "model.max_seq_len=16"]
    cfg = load_config(None, [*sets, f"train.seq_len={SEQ}", "model.mtp_depth=1"])
    torch.manual_seed(0)
    model = GPT(cfg, derive(cfg, 1, vocab_size=VOCAB), ParallelState.single())
    sequence = _tokens((2, SEQ + 1))
    tokens, targets = sequence[:, :-1], sequence[:, 1:]
    future = future_tokens_of(tokens, targets, 1)
    objective = objective_for(cfg, model.ps)
    with torch.no_grad():
        hidden = model.stage_forward(tokens)
        means = objective.losses(model, hidden, MicroBatch(tokens, targets, None, None, future))
        divisor = torch.tensor([2.0, 3.0])
        sums = objective.losses(model, hidden, MicroBatch(tokens, targets, divisor, None, future))
    counted = [targets.numel(), int((future[:, 1, 0] != -100).sum())]  # the last has none
    assert counted[1] == counted[0] - 2
    assert sums.main.item() == pytest.approx(
        means.main.item() * counted[0] / 2, rel=FP32_FEW_OPS_REL
    )
    assert sums.mtp.item() == pytest.approx(means.mtp.item() * counted[1] / 3, rel=FP32_FEW_OPS_REL)
