"""Document masks (data.document_mask): documents and positions found from the end-of-document
tokens before the zigzag split (a blend must share one end-of-document id); a packed sequence
gives each document the attention, logits and gradients it gets alone (fp32, 1e-5; with RoPE
scaling too) in the torch path and in the Triton kernels under the interpreter, which never
read the blocks of other documents (and walk the block pairs scripts/bench_packed_attention.py
counts); training has the same losses at cp 1, cp 2, cp 2 x tp 2 (sequence parallel) and pp 2
(recompute), and other losses than without masks. Ring attention under document masks is
tested with ring attention (tests/context/test_context_ring.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megatronish import ops
from megatronish.config import derive, load_config
from megatronish.context import documents_of
from megatronish.context.zigzag import unshard_sequence
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.model import GPT
from tests import kernel_env  # noqa: F401 (the kernels defined as the kernel tests need them)
from tests.conftest import REPO
from tests.parity import assert_close, make_config, make_trainer, train_losses
from tests.ranks import run_on_ranks
from tests.tolerances import BEYOND_ROUNDING, FP32_REORDER

EOD = 0
BENCH = REPO / "scripts" / "bench_packed_attention.py"


# The documents of a sequence


def test_positions_restart_after_each_end_of_document_token():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9], [5, 6, 7, 8, 9, 1, 2, EOD]])
    docs = documents_of(tokens, EOD)
    assert docs.segments.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    assert docs.segments.dtype == torch.int32 and docs.positions.dtype == torch.int64
    assert torch.equal(docs.shards[:, 0], docs.segments)


def test_a_document_spanning_cp_ranks_keeps_its_segment_and_positions_after_the_zigzag_split():
    # 16 tokens, chunks of 2 over cp 4: the second document runs from chunk 1 to chunk 6.
    tokens = torch.tensor([[4, 4, EOD, *[4] * 10, EOD, 4, 4]])
    whole = documents_of(tokens, EOD)
    shards = [whole.shard(4, rank) for rank in range(4)]
    assert shards[1].segments.tolist() == [[0, 1, 1, 1]]  # chunks 1 and 6: tokens 2, 3, 12, 13
    assert shards[1].positions.tolist() == [[2, 0, 9, 10]]
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.shards[:, rank], shard.segments)
        for other in range(4):
            assert torch.equal(shard.shards[:, other], shards[other].segments)
    assert torch.equal(unshard_sequence([s.positions for s in shards]), whole.positions)
    assert torch.equal(shards[2][0].segments, shards[2].segments[0])  # a micro-batch's


def test_blended_datasets_that_end_documents_with_different_ids_are_a_user_error():
    from megatronish.data.sources import TokenSource, shared_eod_id

    def source(path: str, eot_id: int) -> TokenSource:
        return TokenSource(Path(path), "prepared", None, None, None, 50304, eot_id, "sha")

    assert shared_eod_id([source("a", 256), source("b", 256)]) == 256
    with pytest.raises(UserError) as error:
        shared_eod_id([source("a", 256), source("b", 50256)])
    assert str(error.value) == (
        "data.document_mask: the datasets end documents with different ids (a ends documents "
        "with 256, b ends documents with 50256); blend datasets of one tokenizer, or set "
        "data.document_mask=false (SFT data always trains with document masks)"
    )


# Attention alone


def test_the_gpu_tiles_walk_a_ninth_of_causal_attention_over_128_token_documents_in_2048():
    spec = importlib.util.spec_from_file_location("bench_packed", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kernels = bench.walked(2048, 128, 90)  # sm_90, bf16, head dim 128
    # A 128-query block is one document: 2 key blocks of 64 (forward), 4 of 32 (dQ); a key
    # block of 64 reaches 4 or 2 query blocks of 32 (dK/dV). Causal: 2 (m + 1), 4 (m + 1) and
    # 64 - 2n blocks.
    assert kernels["forward"] == {"tile": (128, 64), "packed": 32, "causal": 272}
    assert kernels["dQ"] == {"tile": (128, 32), "packed": 64, "causal": 544}
    assert kernels["dK/dV"] == {"tile": (32, 64), "packed": 96, "causal": 1056}
    assert bench.flops_walked(kernels) == pytest.approx(2097152 / 19791872)
    assert bench.exact_pairs(2048, 128) == 16 * 128 * 129 / (2048 * 2049)


def _packed_attention(backend: str, lengths: list[int], poisoned: int | None = None):
    """(packed outputs and gradients, each document's alone) of attention over documents of
    these lengths packed into one sequence; `poisoned`: a document whose q, k, v and output
    gradient are NaN in the packed run."""
    gen = torch.Generator().manual_seed(sum(lengths))
    s = sum(lengths)
    q, k, v = (torch.randn(1, n, s, 16, generator=gen) for n in (4, 2, 2))
    dout = torch.randn(1, 4, s, 16, generator=gen)
    tokens = torch.ones(1, s, dtype=torch.long)
    tokens[0, torch.tensor(lengths[:-1]).cumsum(0) - 1] = EOD
    segments = documents_of(tokens, EOD).segments
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    if poisoned is not None:
        rows = slice(starts[poisoned], starts[poisoned] + lengths[poisoned])
        for x in (q, k, v, dout):
            x[:, :, rows] = float("nan")

    def run(rows, segs):
        leaves = [x[:, :, rows].clone().requires_grad_(True) for x in (q, k, v)]
        out = ops.attention(*leaves, causal=True, backend=backend, segments=segs)
        out.backward(dout[:, :, rows])
        return [out.detach()] + [x.grad for x in leaves]

    packed = run(slice(None), segments)
    alone = [run(slice(a, a + n), None) for a, n in zip(starts, lengths)]
    return packed, alone, starts


def _assert_each_document_as_alone(packed, alone, starts, skip=None):
    for index, (start, got) in enumerate(zip(starts, alone)):
        if index == skip:
            continue
        rows = slice(start, start + got[0].shape[2])
        for name, a, b in zip(["out", "dq", "dk", "dv"], packed, got):
            torch.testing.assert_close(
                a[:, :, rows], b, rtol=FP32_REORDER, atol=FP32_REORDER, msg=name
            )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_packed_sequence_gives_each_document_the_attention_and_gradients_it_gets_alone(
    backend, interpreter_env
):
    # Lengths that cross the interpreter's 16- and 32-token tiles at odd places.
    packed, alone, starts = _packed_attention(backend, [7, 1, 30, 19, 13])
    _assert_each_document_as_alone(packed, alone, starts)


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # the NaN document's own
def test_the_triton_kernels_never_read_the_blocks_of_other_documents(interpreter_env):
    # Documents of 32 tokens fill whole tiles (forward and dq 32 x 16, dk/dv 16 x 32): a tile
    # of the NaN document that were read would make the other documents' results NaN.
    packed, alone, starts = _packed_attention("triton", [32, 32, 32], poisoned=1)
    _assert_each_document_as_alone(packed, alone, starts, skip=1)
    with pytest.raises(AssertionError):  # the torch path reads every key: NaN reaches them
        _assert_each_document_as_alone(*_packed_attention("torch", [32, 32], poisoned=0), skip=0)


# The model


def _model(arch: str, backend: str) -> GPT:
    sets = ["model.arch=gpt2"] if arch == "gpt2" else ["model.arch=llama", "model.n_kv_head=1"]
    if arch == "llama yarn":  # scaled RoPE at the positions within each document
        sets += ["model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 8}"]
    sets += ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.vocab_size=61"]
    sets += ["model.max_seq_len=32", "train.seq_len=32", f"kernels.backend={backend}"]
    cfg = load_config(None, sets)
    return GPT(cfg, derive(cfg, 1), ParallelState.single())


@pytest.mark.parametrize(
    ("arch", "backend"),
    [("gpt2", "torch"), ("llama", "torch"), ("llama", "triton"), ("llama yarn", "torch")],
)
def test_a_packed_sequence_gives_each_document_the_logits_and_gradients_it_gets_alone(
    arch, backend, interpreter_env
):
    model = _model(arch, backend)
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 11, 16]
    tokens = torch.randint(1, 61, (1, sum(lengths)), generator=gen)
    tokens[0, [4, 15]] = EOD
    upstream = torch.randn(1, sum(lengths), 61, generator=gen)

    def run(rows, documents):
        model.zero_grad()
        logits = model(tokens[:, rows], documents)[..., :61]  # the real vocabulary
        (logits * upstream[:, rows]).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, packed_grads = run(slice(None), documents_of(tokens, EOD))
    summed = {n: torch.zeros_like(g) for n, g in packed_grads.items()}
    start = 0
    for n in lengths:
        logits, grads = run(slice(start, start + n), None)
        torch.testing.assert_close(
            packed[:, start : start + n], logits, rtol=FP32_REORDER, atol=FP32_REORDER
        )
        for name, grad in grads.items():
            summed[name] += grad
        start += n
    for name, grad in packed_grads.items():
        torch.testing.assert_close(
            grad, summed[name], rtol=FP32_REORDER, atol=FP32_REORDER, msg=name
        )


# Training


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A byte-level dataset of 400 documents of 3 to 13 bytes: a 16-token sample holds two or
    three of them, and documents cross the cp chunks."""
    from megatronish.data import prepare_dataset

    root = tmp_path_factory.mktemp("short-docs")
    lines = [json.dumps({"text": "x" * (i % 7) + f"={i}\n"}) for i in range(400)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return prepare_dataset([str(root / "docs.jsonl")], str(root / "ds"), val_fraction=0.0)


STEPS = 6
MODEL = ["model.arch=llama", "model.n_kv_head=2", "model.n_layer=2", f"train.steps={STEPS}"]
MODEL += ["train.global_batch_size=4"]
MASKED = MODEL + ["data.document_mask=true"]
# name -> (tp, cp, dp, pp, extra settings)
LAYOUTS = {
    "cp2 selective recompute": (1, 2, 1, 1, ["train.activation_checkpointing=selective"]),
    "pp2 full recompute": (1, 1, 1, 2, ["train.activation_checkpointing=full"]),
    "cp2 tp2 sequence parallel": (2, 2, 1, 1, ["parallel.sequence_parallel=true"]),
}


def _train(rank, world, names, dataset):
    losses = {}
    for name in names:
        tp, cp, dp, pp, extra = LAYOUTS[name]
        cfg = make_config(tp, dp, pp, MASKED + extra, dataset, cp=cp)
        losses[name] = train_losses(make_trainer(cfg, world, dataset))
    return losses


def _reference(overrides, dataset) -> list[float]:
    cfg = make_config(1, 1, 1, overrides, dataset)
    return train_losses(make_trainer(cfg, 1, dataset, ParallelState.single()))


@pytest.fixture(scope="module")
def references(short_documents):
    return {
        "masked": _reference(MASKED, short_documents),
        "unmasked": _reference(MODEL, short_documents),
    }


@pytest.mark.slow  # multi-rank training at four layouts
def test_training_with_document_masks_has_the_same_losses_at_cp1_cp2_cp2_tp2_and_pp2(
    short_documents, references
):
    two = run_on_ranks(_train, 2, ["cp2 selective recompute", "pp2 full recompute"],
                       short_documents, timeout=240)  # fmt: skip
    four = run_on_ranks(_train, 4, ["cp2 tp2 sequence parallel"], short_documents, timeout=240)
    for rank_losses in two + four:
        for losses in rank_losses.values():
            assert_close(losses, references["masked"], steps=STEPS)


def test_document_masks_change_the_losses_of_short_documents(references):
    masked, unmasked = references["masked"], references["unmasked"]
    assert all(abs(a - b) > BEYOND_ROUNDING for a, b in zip(masked, unmasked))
