"""A checkpoint runs only as the model it was trained with: resuming, or `eval --set`, with a
model.* key changed (also one that changes no tensor shape: model.n_head at a fixed d_model,
model.rope_theta, model.rope_scaling) is exit status 2 and one line naming the key and both
values (`launch` too, before any rank starts; `check` says it in a note line and still
prints its report), and writes nothing; the same values, or a null standing
for the same value, are accepted, and so is another model.dropout (said in one line). Every key
of the schema's model section takes part, one added later too, and a checkpoint saved before a
key existed compares as its default. A resume under checkpoint.resume=auto says which step it
takes when it passes over newer ones."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from megatronish.checkpoint.model_match import model_differences
from megatronish.config import Config, config_from_dict, load_config
from megatronish.training.resume import auto_choice
from tests.checkpoints import VOCAB, save_single, tiny_cfg
from tests.conftest import CONFIGS, invoke_cli

MODEL = [
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=64",
    "model.max_seq_len=64",
]  # tiny_cfg
TRAIN = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4"]


def train_args(data: Path, checkpoints: Path, out: Path, *extra: str) -> list[str]:
    sets = [*MODEL, *TRAIN, f"data.path={data}", f"checkpoint.dir={checkpoints}"]
    sets += ["train.steps=2", f"run.out_dir={out}", *extra]  # the checkpoint is at step 2
    return ["train", "--config", str(CONFIGS / "tiny.yaml")] + [
        arg for value in sets for arg in ("--set", value)
    ]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A checkpoint.dir holding step_000002 of a tiny gpt2 (tiny_cfg: 4 heads, d_model 64)."""
    directory = tmp_path_factory.mktemp("gpt2") / "ckpt"
    save_single(directory, tiny_cfg())
    return directory


@pytest.fixture(scope="module")
def llama_step(tmp_path_factory) -> Path:
    """The step directory of a tiny llama (rope_theta 10000)."""
    return save_single(tmp_path_factory.mktemp("llama"), tiny_cfg("llama"))[0]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file and directory under root, by relative path."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


def test_resume_with_another_n_head_exits_2_naming_it_and_writes_nothing(
    gpt2_dir, small_dataset, tmp_path
):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    shutil.copytree(gpt2_dir, ckpt)
    run.mkdir()
    before = _tree(tmp_path)
    result = invoke_cli(*train_args(small_dataset, ckpt, run, "model.n_head=8"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        f"error: model.n_head: the checkpoint in {ckpt / 'step_000002'} was trained with 4, the "
        "config asks for 8; keep model.n_head=4, or start over with checkpoint.resume=never or a "
        "new checkpoint.dir"
    ]
    assert result.stdout == ""
    assert _tree(tmp_path) == before


def test_launch_refuses_the_changed_key_before_any_rank_starts_and_check_notes_it(
    gpt2_dir, small_dataset, tmp_path
):
    """launch refuses as train does, before starting ranks; check, which people use to explore
    shapes, prints its report and the refusal as one note line."""
    args = train_args(small_dataset, gpt2_dir, tmp_path / "run", "model.n_head=8")
    refusal = (
        f"model.n_head: the checkpoint in {gpt2_dir / 'step_000002'} was trained with 4, the "
        "config asks for 8; keep model.n_head=4, or start over with checkpoint.resume=never or "
        "a new checkpoint.dir"
    )
    launched = invoke_cli("launch", *args[1:])
    assert (launched.returncode, launched.stderr.splitlines()) == (2, [f"error: {refusal}"])
    assert not (tmp_path / "run").exists()
    checked = invoke_cli("check", *args[1:])
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr.splitlines() == [f"note: train would refuse this config: {refusal}"]
    assert "  n_head: 8\n" in checked.stdout and checked.stdout.endswith("ok\n")


def test_resume_with_the_same_model_written_out_and_another_dropout_goes_on(
    gpt2_dir, small_dataset, tmp_path
):
    # n_kv_head and d_ff are null in the checkpoint: they stand for 4 and 4 x 64.
    same = ["model.n_kv_head=4", "model.d_ff=256", f"model.vocab_size={VOCAB}", "model.dropout=0.1"]
    result = invoke_cli(*train_args(small_dataset, gpt2_dir, tmp_path / "run", *same))
    assert result.returncode == 0, result.stderr[-2000:]
    step_dir = gpt2_dir / "step_000002"
    assert f"checkpoint: model.dropout is 0.1 in this run; {step_dir} was trained with 0.0\n" in (
        result.stdout
    )
    assert f"resumed from {step_dir} at step 2" in result.stdout


def test_eval_with_another_rope_theta_exits_2_and_with_the_same_one_evaluates(
    llama_step, small_dataset
):
    data = f"data.path={small_dataset}"
    other = invoke_cli(
        "eval", "--checkpoint", str(llama_step), "--set", data, "--set", "model.rope_theta=5e5"
    )
    assert other.returncode == 2
    assert other.stderr.splitlines() == [
        f"error: model.rope_theta: the checkpoint in {llama_step} was trained with 10000.0, --set "
        "asks for 500000.0; drop --set model.rope_theta=500000.0: eval runs the model the "
        "checkpoint was trained with"
    ]
    same = invoke_cli(
        "eval", "--checkpoint", str(llama_step), "--set", data, "--set", "model.rope_theta=1e4"
    )
    assert same.returncode == 0, same.stderr
    assert same.stdout.startswith("step 2: val_loss ")


def test_eval_with_another_rope_scaling_exits_2_naming_both_values(llama_step, small_dataset):
    yarn = "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 32}"
    data = f"data.path={small_dataset}"
    other = invoke_cli("eval", "--checkpoint", str(llama_step), "--set", data, "--set", yarn)
    assert other.returncode == 2
    assert other.stderr.splitlines() == [
        f"error: model.rope_scaling: the checkpoint in {llama_step} was trained with null, --set "
        "asks for {type: yarn, factor: 4.0, original_max_position_embeddings: 32, beta_fast: "
        "32.0, beta_slow: 1.0, attention_factor: null, mscale: null, mscale_all_dim: null, "
        "truncate: true}; drop --set model.rope_scaling={type: yarn, factor: 4.0, "
        "original_max_position_embeddings: 32, beta_fast: 32.0, beta_slow: 1.0, "
        "attention_factor: null, mscale: null, mscale_all_dim: null, truncate: true}: eval runs "
        "the model the checkpoint was trained with"
    ]
    # Saved with it (config.yaml written and read back): the same scaling passes, another not.
    saved = config_from_dict(tiny_cfg("llama", yarn).to_dict())
    assert model_differences(saved, VOCAB, tiny_cfg("llama", yarn), VOCAB) == []
    factor_8 = tiny_cfg("llama", yarn, "model.rope_scaling.factor=8")
    assert [d[0] for d in model_differences(saved, VOCAB, factor_8, VOCAB)] == [
        "model.rope_scaling"
    ]


def test_resume_with_a_sliding_window_the_checkpoint_was_trained_without_exits_2(
    llama_step, small_dataset, tmp_path
):
    llama = ["model.arch=llama", "model.n_kv_head=2", "model.d_ff=96", "model.sliding_window=8"]
    args = train_args(small_dataset, llama_step.parent, tmp_path / "run", *llama)
    result = invoke_cli(*args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: model.sliding_window: the checkpoint in {llama_step} was trained with null, the "
        "config asks for 8; keep model.sliding_window=null, or start over with "
        "checkpoint.resume=never or a new checkpoint.dir"
    ]


def test_a_key_missing_from_an_old_checkpoint_compares_as_its_default(llama_step, tmp_path):
    old = tmp_path / "config.yaml"
    lines = (llama_step / "config.yaml").read_text().splitlines(keepends=True)
    old.write_text("".join(x for x in lines if not x.strip().startswith("rope_theta:")))
    saved = load_config(old)
    assert model_differences(saved, VOCAB, tiny_cfg("llama"), VOCAB) == []
    other = tiny_cfg("llama", "model.rope_theta=5e5")
    assert model_differences(saved, VOCAB, other, VOCAB) == [
        ("model.rope_theta", 10000.0, 500000.0)
    ]


def test_every_model_key_is_compared_a_nested_one_and_one_added_to_the_schema_later():
    saved = tiny_cfg("llama", "model.moe.num_experts=2")
    wanted = tiny_cfg("llama", "model.moe.num_experts=2", "model.moe.router=topk_softmax")
    wanted.model.norm_eps = 1e-6
    assert model_differences(saved, VOCAB, wanted, VOCAB) == [
        ("model.norm_eps", 1e-5, 1e-6),
        ("model.moe.router", "softmax_topk", "topk_softmax"),
    ]

    # A key added later, null by default (standing for what derive makes of it: head_dim,
    # d_model / n_head): an old checkpoint records none, so it loads as null and equals the
    # value that null stands for.
    def with_head_dim(head_dim: int | None) -> Config:
        return Config(model=dataclasses.replace(saved.model, head_dim=head_dim))

    assert model_differences(with_head_dim(None), VOCAB, with_head_dim(16), VOCAB) == []
    assert model_differences(with_head_dim(None), VOCAB, with_head_dim(32), VOCAB) == [
        ("model.head_dim", 16, 32)
    ]


def test_resume_auto_says_which_step_it_takes_over_an_incomplete_newer_one(
    gpt2_dir, small_dataset, tmp_path
):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(gpt2_dir, ckpt)
    (ckpt / "step_000004").mkdir()  # its files copied, metadata.json lost
    shutil.copy(ckpt / "step_000002" / "model_tp00.safetensors", ckpt / "step_000004")
    (ckpt / "latest").write_text("step_000004\n")
    result = invoke_cli(*train_args(small_dataset, ckpt, tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    choice = "checkpoint: resuming from step_000002; step_000004 is incomplete (no metadata.json)"
    assert lines.index(choice) + 1 == lines.index(f"resumed from {ckpt / 'step_000002'} at step 2")


def test_resume_auto_names_a_newer_complete_step_that_latest_does_not_name(gpt2_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = load_config(None, [f"checkpoint.dir={ckpt}"])
    shutil.copytree(gpt2_dir, ckpt)
    assert auto_choice(cfg, ckpt / "step_000002") is None  # nothing passed over: no line
    shutil.copytree(ckpt / "step_000002", ckpt / "step_000004")  # saved; `latest` not replaced
    assert auto_choice(cfg, ckpt / "step_000002") == (
        "checkpoint: resuming from step_000002; step_000004 is newer, but 'latest' names "
        "step_000002"
    )
    (ckpt / "step_000004" / "metadata.json").unlink()
    (ckpt / "step_000002" / "metadata.json").unlink()
    assert auto_choice(cfg, None) == (
        "checkpoint: starting fresh; step_000002 is incomplete (no metadata.json); step_000004 "
        "is incomplete (no metadata.json)"
    )
