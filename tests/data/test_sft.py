"""SFT: `prepare --sft` stores a loss mask that counts exactly the responses (and their closing
end-of-text); the loss is the mean over the counted tokens of the whole global batch, the same
at dp 1, dp 2, tp 2, cp 2 and pp 2, with the collectives the analytic count gives;
data.eod_mask_loss leaves the end-of-text targets out; bad records are one line naming file and
line, with nothing left behind; `eval` reads a Megatron prefix and a blend.

The examples are written so that the counted tokens can be told from the text alone: prompts,
system messages and role tags hold no digit and no capital, responses only digits, and the
plain (unmasked) documents only capitals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatronish.data import BatchLoader, prepare_dataset, read_metadata
from megatronish.data.blend import BlendLoader
from megatronish.data.sources import open_source
from tests.conftest import invoke_cli, read_metrics
from tests.parity import GPT2, assert_close, make_config, make_trainer, train_counted
from tests.ranks import run_on_ranks
from tests.tolerances import BEYOND_ROUNDING, FP32_FEW_OPS_REL, FP32_REORDER, LAYOUT_CURVE_REL

pytestmark = pytest.mark.slow  # SFT training at every layout

EOT = 256  # the byte tokenizer's end-of-text id
STEPS = 8
MODEL = GPT2 + ["model.n_layer=2", f"train.steps={STEPS}", "train.eval_every=100"]
MODEL += ["train.eval_steps=2"]
WORDS = ["add", "the", "numbers", "say", "count", "to", "please", "now", "and", "then"]


def sft_records(n: int, seed: int = 0) -> list[dict]:
    """Prompt/response records and multi-turn conversations, responses of digits only."""
    rng = np.random.default_rng(seed)

    def words() -> str:
        return " ".join(rng.choice(WORDS, rng.integers(1, 6)))

    def digits() -> str:
        return "".join(str(d) for d in rng.integers(0, 10, rng.integers(1, 12)))

    records = []
    for i in range(n):
        if i % 3:
            records.append({"prompt": words(), "response": digits()})
        else:
            messages = [{"role": "system", "content": words()}]
            for _ in range(int(rng.integers(1, 3))):
                messages += [
                    {"role": "user", "content": words()},
                    {"role": "assistant", "content": digits()},
                ]
            records.append({"messages": messages})
    return records


def responses(record: dict) -> list[str]:
    if "response" in record:
        return [record["response"]]
    return [m["content"] for m in record["messages"] if m["role"] == "assistant"]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(the SFT dataset prepared by the CLI from two JSON Lines files, their records)."""
    root = tmp_path_factory.mktemp("sft")
    records = sft_records(90)
    first = write_jsonl(root / "a.jsonl", records[:50])
    second = write_jsonl(root / "b.jsonl", records[50:])
    args = ["--input", str(first), "--input", str(second), "--val-fraction", "0.2"]
    result = invoke_cli("prepare", "--sft", *args, "--output", str(root / "ds"))
    assert result.returncode == 0, result.stderr
    return root / "ds", records


def counts(targets: torch.Tensor) -> torch.Tensor:
    """Which targets count, from the text alone: digits, capitals, and the end-of-text."""
    digit = (targets >= ord("0")) & (targets <= ord("9"))
    capital = (targets >= ord("A")) & (targets <= ord("Z"))
    return digit | capital | (targets == EOT)


def counted_by_text(tokens: torch.Tensor, eod_mask_loss: bool = False) -> torch.Tensor:
    """Which targets of windows `tokens` [..., s + 1] count; with eod_mask_loss not those whose
    input is the end-of-text (Megatron's --eod-mask-loss: nothing predicted across documents)."""
    counted = counts(tokens[..., 1:])
    return counted & (tokens[..., :-1] != EOT) if eod_mask_loss else counted


def test_the_mask_counts_exactly_the_responses_and_their_end_of_text(sft_data):
    directory, records = sft_data
    meta = read_metadata(directory, validate=True)
    source = open_source(str(directory))
    tokens = torch.from_numpy(np.asarray(source.tokens, dtype=np.int64))
    expected = sum(len("".join(responses(record))) + 1 for record in records)  # + end-of-text
    assert meta["sft"] is True and meta["counted_tokens"] == expected
    assert meta["n_docs"] == len(records)
    mask = torch.from_numpy(np.asarray(source.loss_mask, dtype=bool))
    assert torch.equal(mask, counts(tokens))
    assert int(mask.sum()) == expected


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_the_loss_is_the_mean_over_exactly_the_counted_targets_of_the_global_batch(
    sft_data, eod_mask_loss
):
    from megatronish.context import documents_of
    from megatronish.distributed.layout import ParallelState

    directory, _ = sft_data
    cfg = make_config(1, 1, 1, MODEL, directory, [f"data.eod_mask_loss={eod_mask_loss}"])
    trainer = make_trainer(cfg, 1, directory, ParallelState.single())
    t = cfg.train
    size = t.global_batch_size  # the whole global batch in one micro-batch on one rank
    whole = BatchLoader(directory, "train", t.seq_len, size, size, 0, 1, t.seed)
    tokens = whole.next_step()[0]  # the global batch of step 1, [G, s + 1]
    targets = tokens[:, 1:]
    counted = counted_by_text(tokens, eod_mask_loss)
    assert trainer.cfg.data.document_mask, "SFT data trains with document masks"
    assert not cfg.data.document_mask, "settled in a copy: the caller's config is as it was"
    with torch.no_grad():
        logits = trainer.model(tokens[:, :-1], documents_of(tokens[:, :-1], EOT)).float()
    per_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), reduction="none"
    ).view_as(targets)
    want = float(per_token[counted].mean())
    micro_means = [float(per_token[i : i + 2][counted[i : i + 2]].mean()) for i in range(0, 8, 2)]
    assert abs(np.nanmean(micro_means) - want) > BEYOND_ROUNDING * want, (
        "micro-batches count unequal tokens"
    )
    assert abs(trainer.train_step().loss - want) <= FP32_REORDER * want


# name -> (tp, dp, cp, pp): each trains the same SFT run as one process does, with the
# document masks a run on SFT data always has (make_trainer opens the data as setup does).
LAYOUTS = {"dp2": (1, 2, 1, 1), "tp2": (2, 1, 1, 1), "cp2": (1, 1, 2, 1), "pp2": (1, 1, 1, 2)}


def _sft_runs(rank, world, layouts, directory):
    """For each layout: losses, grad norms, the validation loss, and the first step's payload
    bytes with the analytic count of them."""
    from megatronish.accounting.collectives import formula_payload_by_kind

    results = {}
    for name, (tp, dp, cp, pp) in layouts.items():
        cfg = make_config(tp, dp, pp, MODEL, directory, cp=cp)
        trainer = make_trainer(cfg, world, directory)
        losses, norms, counter = train_counted(trainer, STEPS)
        formula = formula_payload_by_kind(
            cfg, trainer.setup.derived, trainer.ps.pp_rank, trainer.loader.masks_loss
        )
        results[name] = {
            "losses": losses,
            "norms": norms,
            "val_loss": trainer.evaluate(),
            "payload": dict(counter.payload_bytes),
            "formula": formula,
        }
    return results


def test_an_sft_run_has_the_same_losses_at_dp1_dp2_tp2_cp2_and_pp2_and_the_counted_bytes(
    sft_data,
):
    from megatronish.distributed.layout import ParallelState

    directory, _ = sft_data
    cfg = make_config(1, 1, 1, MODEL, directory)
    trainer = make_trainer(cfg, 1, directory, ParallelState.single())
    assert trainer.loader.masks_loss
    losses, norms, _ = train_counted(trainer, STEPS)
    val_loss = trainer.evaluate()
    assert losses[-1] < losses[0] - 0.5, "the run learns"
    for rank_results in run_on_ranks(_sft_runs, 2, LAYOUTS, directory, timeout=180):
        for name, result in rank_results.items():
            assert_close(result["losses"], losses, steps=STEPS)
            assert_close(result["norms"], norms, steps=STEPS)
            assert abs(result["val_loss"] - val_loss) <= LAYOUT_CURVE_REL * val_loss, name
            assert result["payload"] == result["formula"], name


PLAIN_DOCS = ["ABCDEF", "GHIJ", "KLMNOPQRS", "TUV", "WXYZAB", "CDEFG", "HIJKL"]


def test_loaders_mask_the_targets_as_the_text_says_with_and_without_eod_mask_loss(
    sft_data, tmp_path
):
    directory, _ = sft_data
    files = []
    for i, text in enumerate(PLAIN_DOCS * 6):
        files.append(str(tmp_path / f"{i}.txt"))
        Path(files[-1]).write_text(text)
    plain = prepare_dataset(files, str(tmp_path / "plain"), val_fraction=0.0)
    sizes = dict(seq_len=16, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1)
    unmasked = BatchLoader(plain, "train", seed=1, **sizes)
    assert not unmasked.masks_loss and unmasked.next_masked_step()[1] is None
    sources = [open_source(str(plain)), open_source(str(directory))]
    blend = dict(sources=sources, weights=[0.5, 0.5], split="train", seed=1)
    cases = [  # (loader, eod_mask_loss)
        (BatchLoader(sources[0], "train", seed=1, eod_mask_loss=True, **sizes), True),
        (BlendLoader(**blend, **sizes), False),
        (BlendLoader(**blend, eod_mask_loss=True, **sizes), True),
    ]
    for loader, eod_mask_loss in cases:
        assert loader.masks_loss
        for _ in range(3):
            tokens, mask = loader.next_masked_step()
            assert (tokens[..., :-1] == EOT).any()
            assert torch.equal(mask, counted_by_text(tokens, eod_mask_loss))


BAD_RECORDS = {
    "no response": ({"prompt": "say"}, ["b.jsonl:2:", "'response'", "'messages'"]),
    "unknown role": (
        {"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "1"}]},
        ["b.jsonl:2:", "'bot'", "system, user, assistant"],
    ),
    "ends with the user": (
        {"messages": [{"role": "user", "content": "say"}]},
        ["b.jsonl:2:", "'user'", "assistant"],
    ),
    "not an object": ([1, 2], ["b.jsonl:2:", "object"]),
}


@pytest.mark.parametrize("case", [*BAD_RECORDS, "megatron output"])
def test_bad_sft_input_exits_2_with_one_line_naming_file_and_line_and_leaves_nothing(
    tmp_path, case
):
    good = write_jsonl(tmp_path / "a.jsonl", sft_records(3))
    args = ["prepare", "--sft", "--input", str(good)]
    if case == "megatron output":
        args += ["--output-format", "megatron"]
        wanted = ["--output-format megatron", "loss mask"]
    else:
        record, wanted = BAD_RECORDS[case]
        args += ["--input", str(write_jsonl(tmp_path / "b.jsonl", [sft_records(1)[0], record]))]
    result = invoke_cli(*args, "--output", str(tmp_path / "out"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert all(w in lines[0] for w in wanted), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p for p in ("a.jsonl", "b.jsonl") if (tmp_path / p).exists()
    )


def test_eval_reads_a_megatron_prefix_and_a_blend_as_the_run_validated_them(sft_data, tmp_path):
    from megatronish.data.indexed import write_indexed

    directory, _ = sft_data
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, EOT, rng.integers(5, 40)), EOT) for _ in range(40)]
    write_indexed(tmp_path / "corpus", docs, 300)
    sets = [
        "model.n_layer=1", "model.d_model=32", "model.n_head=4", "model.vocab_size=300",
        "model.max_seq_len=16", "train.seq_len=16", "train.micro_batch_size=2",
        "train.global_batch_size=4", "train.steps=2", "train.eval_every=2", "train.eval_steps=2",
        f"data.blend=0.5 {tmp_path / 'corpus'} 0.5 {directory}", f"data.eod_id={EOT}",
        "data.split=8,2,0", f"run.out_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}",
    ]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    result = invoke_cli("train", "--config", "configs/tiny.yaml", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: SFT examples, packed with document masks" in result.stdout
    saved = (tmp_path / "ck" / "step_000002" / "config.yaml").read_text()
    assert "document_mask: true" in saved  # so eval masks documents as training did
    (logged,) = read_metrics(tmp_path / "run")[1]
    result = invoke_cli("eval", "--checkpoint", str(tmp_path / "ck"))
    assert result.returncode == 0, result.stderr
    blend = json.loads(result.stdout.strip().splitlines()[-1])
    assert abs(blend["val_loss"] - logged["val_loss"]) <= FP32_FEW_OPS_REL * logged["val_loss"]
    only_prefix = ["--set", f"data.path={tmp_path / 'corpus'}"]  # replaces the run's blend
    result = invoke_cli("eval", "--checkpoint", str(tmp_path / "ck"), *only_prefix)
    assert result.returncode == 0, result.stderr
    prefix = json.loads(result.stdout.strip().splitlines()[-1])
    assert prefix["dataset"] == str(tmp_path / "corpus") and prefix["tokens"] == 2 * 4 * 16
    assert np.isfinite(prefix["val_loss"]) and prefix["val_loss"] != blend["val_loss"]


def test_check_shows_the_document_masks_sft_data_trains_with(sft_data):
    directory, _ = sft_data
    result = invoke_cli("check", "--config", "configs/tiny.yaml", "--set", f"data.path={directory}")
    assert result.returncode == 0, result.stderr
    assert "document_mask: true" in result.stdout
