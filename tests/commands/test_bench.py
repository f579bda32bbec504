"""`megatronish bench`: the bytes each rank sends per step, as comm.CommCounter counts them,
equal the analytic formula exactly (tp = 2, dp = 2, tp = 2 x dp = 2), and the command's last
line is one JSON object with the contract's keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronish.accounting.collectives import collectives_per_step, formula_bytes_per_step
from megatronish.config import derive, load_config
from megatronish.data import prepare_dataset
from tests.conftest import invoke_cli
from tests.ranks import run_on_ranks

pytestmark = pytest.mark.slow  # two-rank training runs held to the byte formula

TINY = [
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=4",
    "model.max_seq_len=16",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "checkpoint.save=false",
]
GPT2 = ["model.arch=gpt2"]
LLAMA = ["model.arch=llama", "model.n_kv_head=2"]

# name -> (tp, dp, overrides); global batch 4 per data-parallel rank: 2 accumulation steps.
TWO_RANKS = {
    "gpt2 tp2": (2, 1, GPT2),
    "llama tp2": (2, 1, LLAMA),
    "gpt2 tp2 sequence-parallel": (2, 1, GPT2 + ["parallel.sequence_parallel=true"]),
    "llama tp2 sequence-parallel full-recompute": (
        2, 1, LLAMA + ["parallel.sequence_parallel=true", "train.activation_checkpointing=full"],
    ),
    "gpt2 dp2": (1, 2, GPT2),
    "llama dp2 zero1": (1, 2, LLAMA + ["optim.zero=1"]),
    "gpt2 tp2 bf16": (2, 1, GPT2 + ["train.precision=bf16"]),
    "llama tp2 bf16": (2, 1, LLAMA + ["train.precision=bf16"]),
    "gpt2 tp2 sequence-parallel bf16": (
        2, 1, GPT2 + ["train.precision=bf16", "parallel.sequence_parallel=true"],
    ),
}  # fmt: skip
FOUR_RANKS = {
    "gpt2 tp2 dp2": (2, 2, GPT2),
    "llama tp2 dp2": (2, 2, LLAMA),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small byte-level dataset (no need for the built-in corpus)."""
    root = tmp_path_factory.mktemp("bench-data")
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600))
    (root / "corpus.txt").write_text(text)
    return prepare_dataset([str(root / "corpus.txt")], str(root / "ds"), val_fraction=0.1)


def bench_config(tp: int, dp: int, overrides: list[str], dataset: Path):
    sets = TINY + overrides + [f"parallel.tp={tp}", f"parallel.dp={dp}"]
    return load_config(None, sets + [f"train.global_batch_size={4 * dp}", f"data.path={dataset}"])


def _count_on_ranks(rank, world, variants, dataset):
    """For each variant: (counted, formula) bytes sent per step and payload bytes per kind."""
    from megatronish.accounting.collectives import formula_payload_by_kind
    from megatronish.commands.bench import time_steps
    from megatronish.data.sources import run_data
    from megatronish.distributed.layout import ParallelState
    from megatronish.training.setup import Setup
    from megatronish.training.trainer import Trainer

    results = {}
    for name, (tp, dp, overrides) in variants.items():
        cfg = bench_config(tp, dp, overrides, dataset)
        cfg, data = run_data(cfg)
        derived = derive(cfg, world, vocab_size=data.vocab_size)
        trainer = Trainer(Setup(cfg, derived, ParallelState.from_world(tp, dp), data))
        result = time_steps(trainer, steps=1, warmup=1)
        results[name] = (
            (result.bytes_sent_per_step, formula_bytes_per_step(cfg, derived)),
            (result.payload_per_step, formula_payload_by_kind(cfg, derived)),
        )
    return results


@pytest.fixture(scope="module")
def two_rank_counts(dataset):
    return run_on_ranks(_count_on_ranks, 2, TWO_RANKS, dataset, timeout=180)


@pytest.fixture(scope="module")
def four_rank_counts(dataset):
    return run_on_ranks(_count_on_ranks, 4, FOUR_RANKS, dataset, timeout=180)


def assert_counts_equal_formula(per_rank: list[dict], name: str) -> None:
    for rank, results in enumerate(per_rank):
        (sent, formula), (payload, formula_payload) = results[name]
        assert formula > 0
        assert payload == formula_payload, f"{name}, rank {rank}: payload bytes per kind"
        assert sent == formula, f"{name}, rank {rank}: {sent} bytes sent, formula {formula}"


@pytest.mark.parametrize("name", [n for n in TWO_RANKS if "bf16" not in n])
def test_counted_bytes_per_step_equal_the_formula_on_two_ranks(two_rank_counts, name):
    assert_counts_equal_formula(two_rank_counts, name)


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_counted_bytes_per_step_equal_the_formula_at_tp2_dp2(four_rank_counts, name):
    assert_counts_equal_formula(four_rank_counts, name)


@pytest.mark.parametrize("name", [n for n in TWO_RANKS if "bf16" in n])
def test_bf16_activation_collectives_are_sent_in_bf16(two_rank_counts, name):
    assert_counts_equal_formula(two_rank_counts, name)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_formula_is_the_closed_form_without_sequence_parallelism(tp, precision):
    cfg = load_config(
        None, TINY + GPT2 + [f"parallel.tp={tp}", "train.global_batch_size=6",
                             f"train.precision={precision}"],
    )  # fmt: skip
    derived = derive(cfg, tp, vocab_size=257)
    b, s, h, layers, accum = 2, 16, 32, 2, derived.grad_accum_steps
    c = 2 if precision == "bf16" else 4
    per_micro = (4 + c * (4 * layers + 1)) * b * s * h + 12 * b * s
    ring = 2 * (tp - 1) / tp
    assert accum == 3
    # + 8: the grad-norm all-reduce (fp64); + 16: the step agreement (4 fp32 flags)
    assert formula_bytes_per_step(cfg, derived) == ring * (accum * per_micro + 8 + 16)
    assert {op.kind for op in collectives_per_step(cfg, derived)} == {"all_reduce"}


def test_bench_command_prints_one_json_object_last(tmp_path, dataset, monkeypatch):
    config = tmp_path / "tiny.yaml"
    config.write_text("model: {arch: gpt2, n_layer: 2, n_head: 4, d_model: 32, max_seq_len: 16}\n")
    sets = [f"data.path={dataset}", "train.seq_len=16", "train.micro_batch_size=2"]
    args = [a for s in sets + ["train.global_batch_size=4"] for a in ("--set", s)]
    monkeypatch.chdir(tmp_path)  # one process (world 1): in this one, as from tmp_path
    result = invoke_cli("bench", "--config", str(config), *args, "--steps", "2", "--warmup", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) > 1, "a human summary comes before the JSON line"
    record = json.loads(lines[-1])
    for key in ("tokens_per_s", "step_time_s", "mfu", "bytes_sent_per_step_formula"):
        assert record[key] >= 0, key
    assert record["tokens_per_s"] > 0 and record["step_time_s"] > 0
    assert (record["tp"], record["dp"], record["world_size"]) == (1, 1, 1)
    assert record["bytes_sent_per_step"] == record["comm_calls_per_step"] == 0


def test_bench_command_rejects_a_bad_step_count(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("model: {n_layer: 1}\n")
    result = invoke_cli("bench", "--config", str(config), "--steps", "0")
    assert result.returncode == 2
    assert "--steps" in result.stderr and "Traceback" not in result.stderr
