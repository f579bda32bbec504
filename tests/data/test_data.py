"""The data pipeline: tokenizers, `prepare`, dataset validation, the built-in cache, the loader."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatronish.data import (
    EOT_TOKEN,
    BatchLoader,
    ByteTokenizer,
    builtin_dataset_dir,
    dataset_eot_id,
    dataset_vocab_size,
    load_tokenizer,
    load_tokenizer_file,
    prepare_dataset,
    read_metadata,
    resolve_dataset,
    train_bpe,
)
from megatronish.data import corpus as corpus_module
from megatronish.data import encode as encode_module
from megatronish.data.corpus import builtin_files
from megatronish.errors import UserError
from tests.conftest import invoke_cli

UNICODE_TEXTS = [
    "",
    "plain ascii\n",
    "café naïve résumé Ångström façade",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🚀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "combining e\u0301 and zero\u200bwidth, tab\tCR\r\nNUL\x00 end",
    f"a literal {EOT_TOKEN} inside a text",
    "   leading spaces\n\n\n  and trailing   ",
]


def words_text(rng: np.random.Generator, n_words: int) -> str:
    vocab = ["alpha", "beta", "gamma", "δέλτα", "épsilon", "ζ", "数据", "🙂", "\n", "def", "x"]
    return " ".join(rng.choice(vocab, size=n_words))


def numbered_text(rng: np.random.Generator, doc: int, n_words: int) -> str:
    """Words numbered by document and position (so every short window of it is unique), with
    non-ASCII suffixes."""
    suffixes = rng.choice(["", "é", "数", "🙂", "\n"], size=n_words)
    return " ".join(f"{doc}.{i}{suffix}" for i, suffix in enumerate(suffixes))


def write_corpus(directory: Path, n_docs: int = 30, seed: int = 0) -> list[Path]:
    """n_docs text files of varying length with non-ASCII text, in sorted name order."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(n_docs):
        path = directory / f"doc{index:03d}.txt"
        path.write_text(numbered_text(rng, index, int(rng.integers(10, 150))), encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    """A byte dataset of 30 documents with a 20% validation split."""
    root = tmp_path_factory.mktemp("small")
    write_corpus(root / "corpus")
    dataset = prepare_dataset([str(root / "corpus")], str(root / "ds"), val_fraction=0.2, seed=7)
    for split in ("train", "val"):  # content identifies a sample: tests compare samples by value
        stream = split_stream(dataset, split)
        windows = [stream[i : i + 17].tobytes() for i in range(0, len(stream) - 16, 8)]
        assert len(set(windows)) == len(windows)
    return dataset


@pytest.fixture(scope="module")
def stdlib_sample() -> list[str]:
    root, files = builtin_files()
    return [path.read_text(encoding="utf-8") for path in files[:: max(1, len(files) // 40)]]


def split_stream(dataset: Path, split: str) -> np.ndarray:
    """The split's documents concatenated in document order, computed independently."""
    meta = read_metadata(dataset)
    tokens = np.fromfile(dataset / "tokens.bin", dtype=meta["dtype"])
    offsets = np.load(dataset / "offsets.npy")
    flags = np.load(dataset / "split.npy")
    want = {"train": 0, "val": 1}[split]
    docs = [tokens[offsets[d] : offsets[d + 1]] for d in range(len(flags)) if flags[d] == want]
    return np.concatenate(docs).astype(np.int64)


def same_batches(first: list[np.ndarray], second: list[np.ndarray]) -> bool:
    return len(first) == len(second) and all(map(np.array_equal, first, second))


def run_steps(loader: BatchLoader, steps: int) -> list[np.ndarray]:
    return [loader.next_step().numpy() for _ in range(steps)]


def global_batches(dataset: Path, dp_size: int, steps: int, **kw) -> list[np.ndarray]:
    """Each step's global batch [G, s + 1]: the dp ranks' slices concatenated in rank order."""
    per_rank = [
        run_steps(BatchLoader(dataset, dp_rank=rank, dp_size=dp_size, **kw), steps)
        for rank in range(dp_size)
    ]
    return [
        np.concatenate([per_rank[r][k].reshape(-1, kw["seq_len"] + 1) for r in range(dp_size)])
        for k in range(steps)
    ]


LOADER_ARGS = dict(split="train", seq_len=16, global_batch_size=8, micro_batch_size=2, seed=3)


# Tokenizers


def test_byte_tokenizer_round_trips_unicode_text():
    tok = ByteTokenizer()
    for text in UNICODE_TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(UNICODE_TEXTS) == [tok.encode(text) for text in UNICODE_TEXTS]
    assert (tok.vocab_size, tok.eot_id) == (257, 256)


def test_byte_tokenizer_round_trips_builtin_corpus_sample(stdlib_sample):
    tok = ByteTokenizer()
    arrays = tok.encode_arrays(stdlib_sample)
    for text, array in zip(stdlib_sample, arrays, strict=True):
        assert tok.decode(array) == text
        assert array.tolist() == tok.encode(text)


def test_byte_decode_replaces_only_invalid_sequences_and_renders_eot():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("é") + [256]) == "é" + EOT_TOKEN
    assert tok.decode([0xC3]) == "\ufffd"
    assert tok.decode([ord("a"), 0xE2, 0x82, ord("b")]) == "a\ufffdb"
    with pytest.raises(ValueError):
        tok.decode([257])


@pytest.fixture(scope="module")
def small_bpe(stdlib_sample):
    return train_bpe(iter(stdlib_sample + UNICODE_TEXTS), vocab_size=512)


def test_bpe_round_trips_builtin_sample_and_unicode(small_bpe, stdlib_sample):
    assert small_bpe.vocab_size <= 512 and small_bpe.decode([small_bpe.eot_id]) == EOT_TOKEN
    for text in stdlib_sample + UNICODE_TEXTS + ["never seen: Ωμέγα 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃"]:
        assert small_bpe.decode(small_bpe.encode(text)) == text
    batch = small_bpe.encode_batch(stdlib_sample[:5])
    assert batch == [small_bpe.encode(text) for text in stdlib_sample[:5]]
    n_bytes = sum(len(t.encode()) for t in stdlib_sample)
    assert sum(len(ids) for ids in small_bpe.encode_batch(stdlib_sample)) < 0.7 * n_bytes


def test_tokenizer_file_finds_its_end_of_text_token(tmp_path, small_bpe):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    for special, expect_ok in (["</s>"], True), (["<eos>"], True), (["<pad>"], False):
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
        core.train_from_iterator(["some text to learn from"] * 10, trainer=trainer)
        path = tmp_path / f"{special[0].strip('<>/')}.json"
        core.save(str(path))
        if expect_ok:
            assert load_tokenizer_file(path).eot_id == core.token_to_id(special[0])
        else:
            with pytest.raises(UserError, match=str(path)):
                load_tokenizer_file(path)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(UserError, match="junk.json"):
        load_tokenizer_file(tmp_path / "junk.json")


# prepare


def test_prepare_byte_metadata_matches_the_files(tmp_path):
    paths = write_corpus(tmp_path / "corpus", n_docs=12)
    ds = prepare_dataset([str(tmp_path / "corpus")], str(tmp_path / "ds"), val_fraction=0.25)
    meta = read_metadata(ds, validate=True)
    tokens = np.fromfile(ds / "tokens.bin", dtype=np.uint16)
    offsets = np.load(ds / "offsets.npy")
    split = np.load(ds / "split.npy")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and meta["eot_id"] == 256
    assert meta["n_tokens"] == len(tokens) == offsets[-1]
    assert meta["n_docs"] == len(paths) == len(offsets) - 1 == len(split)
    assert meta["val_docs"] == 3 == int(split.sum())
    val_tokens = sum(offsets[d + 1] - offsets[d] for d in range(len(split)) if split[d])
    assert meta["val_tokens"] == val_tokens and meta["train_tokens"] == len(tokens) - val_tokens
    assert meta["sha256"] == hashlib.sha256(tokens.tobytes()).hexdigest()
    assert meta["text_bytes"] == sum(p.stat().st_size for p in paths)
    tok = load_tokenizer(ds)
    for d, path in enumerate(paths):
        doc = tokens[offsets[d] : offsets[d + 1]]
        assert doc[-1] == 256 and 256 not in doc[:-1]
        assert tok.decode(doc[:-1]) == path.read_text(encoding="utf-8")
    assert dataset_vocab_size(ds) == 257 and dataset_eot_id(ds) == 256


def test_prepare_bpe_writes_its_tokenizer_and_round_trips(tmp_path):
    paths = write_corpus(tmp_path / "corpus", n_docs=8)
    ds = prepare_dataset(
        [str(tmp_path / "corpus")], str(tmp_path / "ds"), tokenizer="bpe", vocab_size=300
    )
    meta = read_metadata(ds, validate=True)
    assert meta["tokenizer"]["kind"] == "bpe" and (ds / "tokenizer.json").is_file()
    assert meta["vocab_size"] <= 300 and meta["n_tokens"] < meta["text_bytes"]
    tok = load_tokenizer(ds)
    tokens = np.fromfile(ds / "tokens.bin", dtype=meta["dtype"])
    offsets = np.load(ds / "offsets.npy")
    for d, path in enumerate(paths):
        doc = tokens[offsets[d] : offsets[d + 1]]
        assert doc[-1] == meta["eot_id"] and tok.decode(doc[:-1]) == path.read_text("utf-8")
    again = prepare_dataset(
        [str(tmp_path / "corpus")], str(tmp_path / "ds2"), tokenizer=str(ds / "tokenizer.json")
    )
    assert read_metadata(again)["tokenizer"]["kind"] == "file"
    assert (again / "tokens.bin").read_bytes() == (ds / "tokens.bin").read_bytes()


def test_prepare_jsonl_takes_one_document_per_record(tmp_path):
    records = [{"text": t, "id": i} for i, t in enumerate(UNICODE_TEXTS)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    ds = prepare_dataset([str(path)], str(tmp_path / "ds"), val_fraction=0.0)
    meta = read_metadata(ds)
    assert meta["n_docs"] == len([t for t in UNICODE_TEXTS if t]) and meta["val_docs"] == 0
    tokens = np.fromfile(ds / "tokens.bin", dtype=np.uint16)
    assert ByteTokenizer().decode(tokens) == "".join(t + EOT_TOKEN for t in UNICODE_TEXTS if t)
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    ds2 = prepare_dataset(
        [str(tmp_path / "other.jsonl")], str(tmp_path / "ds2"), jsonl_field="body"
    )
    assert read_metadata(ds2)["n_tokens"] == 2


def test_prepare_directory_skips_binary_files_and_honours_glob(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("text a")
    (corpus / "sub" / "b.md").write_text("text b")
    (corpus / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00" + bytes(range(256)))
    (corpus / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (corpus / ".hidden").write_text("hidden")
    ds = prepare_dataset([str(corpus)], str(tmp_path / "ds"))
    meta = read_metadata(ds)
    assert (meta["n_docs"], meta["skipped_files"]) == (2, 2)
    decoded = ByteTokenizer().decode(np.fromfile(ds / "tokens.bin", dtype=np.uint16))
    assert decoded == f"text a{EOT_TOKEN}text b{EOT_TOKEN}"
    ds_glob = prepare_dataset([str(corpus)], str(tmp_path / "ds_glob"), glob_pattern="*.md")
    assert read_metadata(ds_glob)["n_tokens"] == len("text b") + 1
    with pytest.raises(UserError, match="no files matching"):
        prepare_dataset([str(corpus)], str(tmp_path / "ds_none"), glob_pattern="*.rst")


def test_large_files_stream_in_pieces_with_identical_tokens(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.txt").write_text(words_text(rng, 3000) + "no newline at all" * 40, "utf-8")
    (corpus / "small.txt").write_text("é" * 501, "utf-8")
    whole = prepare_dataset([str(corpus)], str(tmp_path / "whole"))
    monkeypatch.setattr(corpus_module, "READ_CHUNK", 97)
    monkeypatch.setattr(encode_module, "BATCH_CHARS", 50)
    pieces = prepare_dataset([str(corpus)], str(tmp_path / "pieces"))
    assert (pieces / "tokens.bin").read_bytes() == (whole / "tokens.bin").read_bytes()
    assert np.array_equal(np.load(pieces / "offsets.npy"), np.load(whole / "offsets.npy"))


def test_prepare_refuses_a_non_empty_output_and_accepts_an_empty_one(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=2)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="full"):
        prepare_dataset([str(tmp_path / "corpus")], str(tmp_path / "full"))
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    prepare_dataset([str(tmp_path / "corpus")], str(tmp_path / "empty"))
    assert read_metadata(tmp_path / "empty")["n_docs"] == 2


def test_failed_prepare_leaves_nothing_behind(tmp_path):
    good = json.dumps({"text": "fine"})
    (tmp_path / "data.jsonl").write_text(good + "\n" + good + "\n" + json.dumps({"t": 1}) + "\n")
    with pytest.raises(UserError, match=r"data.jsonl:3: .*'text'"):
        prepare_dataset([str(tmp_path / "data.jsonl")], str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["data.jsonl"]


def test_interrupted_prepare_leaves_nothing_behind(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", n_docs=3)

    def interrupted(self, texts):
        raise KeyboardInterrupt

    monkeypatch.setattr(ByteTokenizer, "encode_arrays", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset([str(tmp_path / "corpus")], str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["corpus"]


def test_vocab_beyond_65536_ids_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, EOT_TOKEN: 70_001}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.save(str(tmp_path / "big.json"))
    (tmp_path / "doc.txt").write_text("w69999 w3 w65536 nope")
    ds = prepare_dataset(
        [str(tmp_path / "doc.txt")], str(tmp_path / "ds"), tokenizer=str(tmp_path / "big.json")
    )
    meta = read_metadata(ds, validate=True)
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_002, 70_001)
    assert np.fromfile(ds / "tokens.bin", "<u4").tolist() == [69_999, 3, 65_536, 70_000, 70_001]


def test_split_is_by_documents_and_seeded(tmp_path):
    write_corpus(tmp_path / "corpus", n_docs=40)
    inputs = [str(tmp_path / "corpus")]
    a = np.load(
        prepare_dataset(inputs, str(tmp_path / "a"), val_fraction=0.1, seed=1) / "split.npy"
    )
    b = np.load(
        prepare_dataset(inputs, str(tmp_path / "b"), val_fraction=0.1, seed=1) / "split.npy"
    )
    c = np.load(
        prepare_dataset(inputs, str(tmp_path / "c"), val_fraction=0.1, seed=2) / "split.npy"
    )
    assert a.sum() == 4 and np.array_equal(a, b) and not np.array_equal(a, c)


# Dataset validation


def test_read_metadata_names_the_broken_file(tmp_path, small_dataset):
    import shutil

    with pytest.raises(UserError, match="does not exist"):
        read_metadata(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match="metadata.json"):
        read_metadata(tmp_path / "plain")
    broken = tmp_path / "broken"
    shutil.copytree(small_dataset, broken)
    (broken / "metadata.json").write_text("{ truncated")
    with pytest.raises(UserError, match=r"metadata.json: not valid JSON"):
        read_metadata(broken)
    truncated = tmp_path / "truncated"
    shutil.copytree(small_dataset, truncated)
    data = (truncated / "tokens.bin").read_bytes()
    (truncated / "tokens.bin").write_bytes(data[:-2])
    with pytest.raises(UserError, match=r"tokens.bin: .*truncated"):
        read_metadata(truncated)
    beyond = tmp_path / "beyond"
    shutil.copytree(small_dataset, beyond)
    tokens = np.fromfile(beyond / "tokens.bin", dtype=np.uint16)
    tokens[5] = 300
    tokens.tofile(beyond / "tokens.bin")
    read_metadata(beyond)  # the cheap check does not scan the tokens
    with pytest.raises(UserError, match=r"tokens.bin: token id 300 at index 5 is beyond"):
        read_metadata(beyond, validate=True)
    with pytest.raises(UserError, match="tokens.bin"):
        resolve_dataset(str(beyond))
    offsets_bad = tmp_path / "offsets_bad"
    shutil.copytree(small_dataset, offsets_bad)
    np.save(offsets_bad / "offsets.npy", np.zeros(3, dtype=np.int64))
    with pytest.raises(UserError, match="offsets.npy"):
        read_metadata(offsets_bad)


# The built-in corpus cache


def test_builtin_dataset_is_prepared_once_and_shared_by_concurrent_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRONISH_CACHE", str(tmp_path / "cache"))
    code = "from megatronish.data import builtin_dataset_dir; print(builtin_dataset_dir())"
    env = dict(os.environ, MEGATRONISH_CACHE=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0].strip().splitlines()[-1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs[0] == outputs[1]
    assert os.listdir(tmp_path / "cache") == [Path(outputs[0]).name]  # no staging left
    directory = builtin_dataset_dir()
    assert str(directory) == outputs[0]
    mtime = (directory / "tokens.bin").stat().st_mtime_ns
    assert builtin_dataset_dir() == directory == resolve_dataset(None)
    assert (directory / "tokens.bin").stat().st_mtime_ns == mtime
    meta = read_metadata(directory, validate=True)
    root, files = builtin_files()
    assert meta["builtin"] and meta["sources"] == [str(root)] and meta["n_files"] == len(files)
    assert meta["n_docs"] == sum(1 for f in files if f.stat().st_size > 0)
    assert meta["val_docs"] >= 1
    (directory / "tokens.bin").write_bytes(b"")  # damaged: rebuilt on the next call
    assert read_metadata(builtin_dataset_dir())["sha256"] == meta["sha256"]


def test_the_run_that_prepares_the_builtin_corpus_says_so_in_one_line_on_rank_0_only(
    tmp_path, monkeypatch, capsys
):
    sets = ["model.n_layer=1", "model.d_model=32", "model.max_seq_len=16", "train.seq_len=16"]
    sets += ["train.steps=1", "train.eval_every=0", "checkpoint.save=false"]
    sets += [f"run.out_dir={tmp_path / 'run'}"]
    env = {"MEGATRONISH_CACHE": str(tmp_path / "cache")}
    args = ["train", "--config", "configs/tiny.yaml", *(a for s in sets for a in ("--set", s))]
    said = []
    for _ in range(2):
        result = invoke_cli(*args, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        said.append([x for x in result.stdout.splitlines() if x.startswith("preparing the")])
    (directory,) = (tmp_path / "cache").iterdir()
    _, files = builtin_files()
    mb = sum(f.stat().st_size for f in files) / 1e6
    assert said == [
        [
            "preparing the built-in corpus (the Python standard library's sources: "
            f"{len(files):,} files, {mb:.1f} MB) into {directory} ..."
        ],
        [],  # cached
    ]
    monkeypatch.setenv("MEGATRONISH_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("RANK", "1")  # another rank of a torchrun prepares it quietly
    capsys.readouterr()
    assert builtin_dataset_dir().parent == tmp_path / "other"
    assert capsys.readouterr().out == ""


# The loader


def test_loader_batches_are_shifted_windows_of_the_split_stream(small_dataset):
    for split in ("train", "val"):
        stream = split_stream(small_dataset, split)
        loader = BatchLoader(small_dataset, **{**LOADER_ARGS, "split": split}, dp_rank=0, dp_size=1)
        assert loader.n_samples == (len(stream) - 1) // 16
        batch = loader.next_step()
        assert batch.shape == (4, 2, 17) and str(batch.dtype) == "torch.int64"
        starts = {stream[i * 16 : i * 16 + 17].tobytes(): i for i in range(loader.n_samples)}
        for sample in batch.reshape(-1, 17).numpy():
            assert sample.tobytes() in starts


def test_loader_is_identical_for_every_tp_rank_of_a_dp_group(small_dataset):
    for rank in (0, 1):
        a = run_steps(BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=rank, dp_size=2), 5)
        b = run_steps(BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=rank, dp_size=2), 5)
        assert same_batches(a, b)


def test_loader_dp_ranks_are_disjoint_and_global_batches_match_dp1(small_dataset):
    n_samples = BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=0, dp_size=1).n_samples
    steps = n_samples // 8 + 3  # crosses an epoch boundary
    dp1 = global_batches(small_dataset, 1, steps, **LOADER_ARGS)
    dp2 = global_batches(small_dataset, 2, steps, **LOADER_ARGS)
    assert same_batches(dp1, dp2)
    ranks = [BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=r, dp_size=2) for r in (0, 1)]
    for _ in range(n_samples // 8):  # within one epoch no sample repeats, so none is shared
        first, second = (r.next_step().reshape(-1, 17).numpy() for r in ranks)
        assert not {s.tobytes() for s in first} & {s.tobytes() for s in second}


def test_loader_never_repeats_a_sample_within_an_epoch(small_dataset):
    loader = BatchLoader(
        small_dataset,
        **{**LOADER_ARGS, "global_batch_size": 1, "micro_batch_size": 1},
        dp_rank=0,
        dp_size=1,
    )
    stream = split_stream(small_dataset, "train")
    every = sorted(stream[i * 16 : i * 16 + 17].tobytes() for i in range(loader.n_samples))
    for epoch in range(2):
        seen = [loader.next_step().numpy().tobytes() for _ in range(loader.n_samples)]
        assert sorted(seen) == every and loader.epoch == epoch + 1
    first_order = [loader.sample_ids(i, 1)[0] for i in range(loader.n_samples)]
    second_order = [loader.sample_ids(loader.n_samples + i, 1)[0] for i in range(loader.n_samples)]
    assert first_order != second_order  # each epoch is shuffled anew


def test_loader_resumes_exactly_mid_epoch_and_across_an_epoch_boundary(small_dataset):
    reference = BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=1, dp_size=2)
    per_epoch = reference.n_samples // 8
    expected = run_steps(reference, per_epoch + 4)
    for stop in (2, per_epoch, per_epoch + 1):
        first = BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=1, dp_size=2)
        run_steps(first, stop)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=1, dp_size=2)
        resumed.load_state_dict(state)
        rest = run_steps(resumed, per_epoch + 4 - stop)
        assert same_batches(rest, expected[stop:])


def test_loader_resumes_at_another_dp_size(small_dataset):
    dp1 = BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=0, dp_size=1)
    expected = global_batches(small_dataset, 1, 6, **LOADER_ARGS)[3:]
    run_steps(dp1, 3)
    state = dp1.state_dict()
    ranks = [BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=r, dp_size=2) for r in (0, 1)]
    for loader in ranks:
        loader.load_state_dict(state)
    for want in expected:
        got = np.concatenate([r.next_step().reshape(-1, 17).numpy() for r in ranks])
        assert np.array_equal(got, want)


def test_loader_state_from_other_settings_is_a_user_error(small_dataset):
    state = BatchLoader(small_dataset, **LOADER_ARGS, dp_rank=0, dp_size=1).state_dict()
    for change in ({"seq_len": 8}, {"global_batch_size": 16}, {"seed": 4}):
        other = BatchLoader(small_dataset, **{**LOADER_ARGS, **change}, dp_rank=0, dp_size=1)
        with pytest.raises(UserError, match=next(iter(change))):
            other.load_state_dict(state)


def test_val_loader_wraps_around_and_reset_repeats_it(small_dataset):
    seq_len = read_metadata(small_dataset)["val_tokens"] // 5
    args = {**LOADER_ARGS, "split": "val", "seq_len": seq_len}
    loader = BatchLoader(small_dataset, **args, dp_rank=0, dp_size=1)
    assert loader.n_samples < 8  # fewer samples than one global batch
    first = run_steps(loader, 3)
    samples = {row.tobytes() for row in first[0].reshape(-1, seq_len + 1)}
    assert len(samples) == loader.n_samples  # one batch already holds every sample
    loader.reset()
    again = run_steps(loader, 3)
    assert same_batches(first, again)


def test_loader_rejects_a_split_too_small_and_an_indivisible_batch(small_dataset):
    val_tokens = read_metadata(small_dataset)["val_tokens"]
    expected = rf"{re.escape(str(small_dataset))}: the val split .* = {val_tokens + 1} tokens"
    with pytest.raises(UserError, match=expected):
        BatchLoader(
            small_dataset,
            **{**LOADER_ARGS, "split": "val", "seq_len": val_tokens},
            dp_rank=0,
            dp_size=1,
        )
    with pytest.raises(UserError, match="global_batch_size 8 must be a multiple"):
        BatchLoader(small_dataset, **{**LOADER_ARGS, "micro_batch_size": 3}, dp_rank=0, dp_size=1)
