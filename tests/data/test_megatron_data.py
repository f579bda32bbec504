"""Megatron indexed datasets (read in place, converted both ways, checked against megatron-core's
own reader), blends (shares, resumption, layout) and splits."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from megatronish.data.blend import BlendLoader, assign
from megatronish.data.indexed import read_indexed, write_indexed
from megatronish.data.sources import open_source, parse_blend, resolve_data, split_flags
from megatronish.errors import UserError
from tests.conftest import invoke_cli
from tests.parity import GPT2, assert_close, make_config
from tests.ranks import run_on_ranks
from tests.tolerances import BLEND_COUNT_ABS

VOCAB, EOD = 300, 299


def random_documents(n_docs: int, seed: int = 0, longest: int = 120) -> list[np.ndarray]:
    """Documents of random ids below EOD, each ending in EOD, of odd and varied lengths."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(0, EOD, rng.integers(1, longest)), EOD) for _ in range(n_docs)]


def write_with_megatron_core(prefix: Path, documents: list[np.ndarray]) -> bool:
    """Writes the prefix with megatron-core's builder when it is installed (else ours); True
    when megatron-core wrote it."""
    try:
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError:
        write_indexed(prefix, documents, VOCAB)
        return False
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in documents:
        builder.add_item(torch.from_numpy(doc.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return True


def documents_of(source) -> list[np.ndarray]:
    offsets = np.asarray(source.offsets)
    return [np.asarray(source.tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def assert_same_documents(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def test_documents_survive_megatron_to_ours_to_megatron_as_megatron_core_reads_them(tmp_path):
    indexed = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset", reason="megatron-core is not installed"
    )
    docs = random_documents(57)
    write_with_megatron_core(tmp_path / "mc", docs)
    ours, back = tmp_path / "ours", tmp_path / "out" / "back"
    sets = ["--vocab-size", str(VOCAB), "--eod-id", str(EOD)]
    result = invoke_cli(
        "prepare", "--input", str(tmp_path / "mc.idx"), *sets, "--output", str(ours)
    )
    assert result.returncode == 0, result.stderr
    assert_same_documents(documents_of(open_source(str(ours))), docs)
    result = invoke_cli(
        "prepare", "--input", str(ours), "--output-format", "megatron", "--output", str(back)
    )
    assert result.returncode == 0, result.stderr
    theirs = indexed.IndexedDataset(str(back))
    assert theirs.index.dtype == np.uint16, "uint16 ids when the vocabulary fits, as Megatron"
    assert_same_documents([theirs[i] for i in range(len(theirs))], docs)
    assert np.array_equal(theirs.document_indices, np.arange(len(docs) + 1))


def _train_prefix(rank: int, world: int, tp: int, prefix: str, out_dir: str) -> list[float]:
    from megatronish.config import derive
    from megatronish.distributed import comm
    from megatronish.distributed.layout import ParallelState, use_shared_memory
    from megatronish.training.setup import Setup
    from megatronish.training.trainer import Trainer
    from tests.parity import train_losses

    extra = [f"data.eod_id={EOD}", f"model.vocab_size={VOCAB}", "train.steps=3"]
    cfg = make_config(tp, 1, 1, GPT2, Path(prefix), [*extra, f"run.out_dir={out_dir}"])
    data = resolve_data(cfg.data.path, None, None, VOCAB, EOD)
    derived = derive(cfg, world, vocab_size=data.vocab_size)
    if world == 1:
        ps = ParallelState.single()
    else:
        comm.disable_shared_memory()
        ps = ParallelState.from_world(derived.tp, derived.dp, derived.pp, derived.cp, derived.ep)
        ps = use_shared_memory(ps, 120)
    trainer = Trainer(Setup(cfg, derived, ps, data))
    trainer.write_run_files()  # data.json among them, as a run writes them when it starts
    return train_losses(trainer)


def test_a_megatron_core_prefix_trains_in_place_at_tp2_as_at_tp1(tmp_path):
    prefix = tmp_path / "corpus"
    write_with_megatron_core(prefix, random_documents(40, seed=1))
    one = _train_prefix(0, 1, 1, str(prefix), str(tmp_path / "tp1"))
    two = run_on_ranks(_train_prefix, 2, 2, str(prefix), str(tmp_path / "tp2"), timeout=120)
    for losses in two:
        assert_close(losses, one, steps=3)
    report = json.loads((tmp_path / "tp1" / "data.json").read_text())
    assert report == {"datasets": [{"path": str(prefix), "weight": 1.0, "samples": 3 * 8}]}


@pytest.mark.parametrize(
    "sets, key",
    [
        (["model.vocab_size=null", f"data.eod_id={EOD}"], "model.vocab_size"),
        (["model.vocab_size=null"], "model.vocab_size, data.eod_id: required"),  # both, at once
        ([f"model.vocab_size={VOCAB}"], "data.eod_id"),
        ([f"model.vocab_size={EOD}", "data.eod_id=0"], "model.vocab_size"),  # id EOD too big
        ([f"model.vocab_size={VOCAB}", f"data.eod_id={EOD}", "data.split=9,x"], "data.split"),
    ],
)
def test_a_prefix_without_what_it_needs_exits_2_naming_the_key(tmp_path, sets, key):
    write_indexed(tmp_path / "p", random_documents(5), VOCAB)
    args = [a for s in [f"data.path={tmp_path / 'p'}", "train.eval_every=0", *sets]
            for a in ("--set", s)]  # fmt: skip
    result = invoke_cli("check", "--config", "configs/tiny.yaml", *args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert key in result.stderr, result.stderr


def test_a_prefix_blends_with_a_dataset_of_a_tokenizer_only_at_its_eod_id_and_within_its_ids(
    tmp_path, dataset
):
    rng = np.random.default_rng(0)
    byte_docs = [np.append(rng.integers(0, 256, 30), 256) for _ in range(5)]
    write_indexed(tmp_path / "bytes", byte_docs, VOCAB)
    blend = f"0.5 {dataset} 0.5 {tmp_path / 'bytes'}"
    plan = resolve_data(None, blend, None, VOCAB, 256)
    assert plan.tokenizer_source.path == dataset  # what checkpoints record
    with pytest.raises(UserError) as error:
        resolve_data(None, blend, None, VOCAB, EOD)
    assert str(error.value) == (
        f"data.blend: {dataset} uses tokenizer byte (vocab 257, end of text 256) but "
        f"{tmp_path / 'bytes'} is a Megatron prefix without a tokenizer (end of text {EOD} from "
        "data.eod_id, largest id 256); the datasets of one run must share a tokenizer (one "
        "without its own must share its end-of-text id and vocabulary)"
    )
    wide = np.append(rng.integers(0, VOCAB, 30), 256)
    assert wide.max() >= 257  # ids beyond the byte vocabulary
    write_indexed(tmp_path / "wide", [wide], VOCAB)
    with pytest.raises(
        UserError, match=f"end of text 256 from data.eod_id, largest id {wide.max()}"
    ):
        resolve_data(None, f"0.5 {dataset} 0.5 {tmp_path / 'wide'}", None, VOCAB, 256)


def test_a_damaged_or_mismatched_prefix_is_a_user_error_naming_the_file(tmp_path):
    prefix = tmp_path / "p"
    write_indexed(prefix, random_documents(6), VOCAB)
    idx, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    good_idx, good_bin = idx.read_bytes(), data.read_bytes()
    for idx_bytes, bin_bytes, named in [
        (b"XXXX" + good_idx[4:], good_bin, idx),  # bad magic
        (good_idx[:-3], good_bin, idx),  # truncated index
        (good_idx, good_bin[:-2], data),  # a data file shorter than the index says
        (good_idx[:18] + struct.pack("<Q", 7) + good_idx[26:], good_bin, idx),  # wrong count
    ]:
        idx.write_bytes(idx_bytes)
        data.write_bytes(bin_bytes)
        with pytest.raises(UserError, match=str(named)):
            read_indexed(prefix)


def test_prepare_to_megatron_leaves_nothing_behind_when_it_fails(tmp_path):
    write_indexed(tmp_path / "p", random_documents(6), VOCAB)
    out = tmp_path / "out" / "q"
    args = ["--input", str(tmp_path / "p.idx"), "--eod-id", "0", "--output", str(out)]
    result = invoke_cli("prepare", *args, "--vocab-size", "100", "--output-format", "megatron")
    assert result.returncode == 2 and "--vocab-size" in result.stderr and "p.bin" in result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("bad", ["0.3 a -0.7 b", "0.3 a 0 b", "x a", "0.3 a 0.7", "nan a"])
def test_blend_weights_must_be_positive_numbers(bad):
    with pytest.raises(UserError, match="data.blend"):
        parse_blend(bad)


def test_blend_accepts_megatron_syntax_and_a_list_of_path_weight(tmp_path):
    from megatronish.config import load_config

    assert parse_blend("0.3 A 0.7 B") == [("A", 0.3), ("B", 0.7)]
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  blend:\n    - {path: A, weight: 1}\n    - {path: B, weight: 3}\n")
    assert parse_blend(load_config(config).data.blend) == [("A", 1.0), ("B", 3.0)]
    assert load_config(config, ["data.blend=0.3 A 0.7 B"]).data.blend == "0.3 A 0.7 B"


def test_over_10000_samples_each_dataset_share_is_within_1_percent_of_its_weight():
    weights = np.array([0.2, 0.05, 0.5, 0.25])
    for phase in (0.0, 0.37, 0.99):
        which = assign(np.arange(10_000), np.cumsum(weights), phase)
        shares = np.bincount(which, minlength=4) / 10_000
        assert np.all(np.abs(shares - weights) <= 0.01 * weights), shares


def _blend(tmp_path: Path, dp_rank: int = 0, dp_size: int = 1, split: str = "train"):
    small, large = tmp_path / "small", tmp_path / "large"
    if not Path(f"{small}.idx").exists():
        write_indexed(small, random_documents(8, seed=2, longest=30), VOCAB)  # a few samples
        write_indexed(large, random_documents(200, seed=3), VOCAB)
    data = resolve_data(None, f"0.7 {small} 0.3 {large}", "8,2,0", VOCAB, EOD)
    return BlendLoader(data.sources, data.weights, split, 16, 8, 2, dp_rank, dp_size, 5)


def test_a_blend_follows_its_weights_not_the_dataset_sizes(tmp_path):
    loader = _blend(tmp_path)
    assert loader.counts_before(10_000).tolist() == pytest.approx([7000, 3000], abs=BLEND_COUNT_ABS)
    assert loader.parts[0].n_samples < 20 < loader.parts[1].n_samples


def test_a_resumed_blend_gives_the_samples_of_the_uninterrupted_run_at_any_dp(tmp_path):
    whole = _blend(tmp_path)
    steps = [whole.next_step().reshape(8, -1) for _ in range(6)]
    first = _blend(tmp_path)
    for _ in range(3):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))
    ranks = [_blend(tmp_path, rank, 2) for rank in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    for step in steps[3:]:
        resumed = np.concatenate([loader.next_step().reshape(4, -1) for loader in ranks])
        assert np.array_equal(resumed, step.numpy())
    assert not np.array_equal(steps[0], steps[1])


def test_a_blend_validation_split_comes_from_data_split(tmp_path):
    val = _blend(tmp_path, split="val")
    assert [p.source.docs_in("val") for p in val.parts] == [2, 40]
    assert val.next_step().shape == (4, 2, 17)


def test_split_969_30_1_gives_contiguous_runs_as_megatron_does():
    flags = split_flags(1000, "969,30,1")
    assert np.bincount(flags, minlength=3).tolist() == [969, 30, 1]
    assert np.all(np.diff(flags.astype(int)) >= 0)
    assert np.bincount(split_flags(7, "1,1,1"), minlength=3).tolist() == [3, 2, 2]
