"""What import and training from a Hugging Face directory make of what config.json does not
say alone: a tied config whose weights hold a distinct output layer loads as transformers loads
it; training-time noise is one note line; a config that differs from the directory's model is
one line naming every difference and the --set options that match it; a DeepSeek-V3 without
rope scaling trains from its own imported config. (tiny random transformers models, fp32)"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from megatronish import load_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.hf.importer import check_hf_matches, init_from_hf, one_process, read_hf
from megatronish.model import GPT
from tests.conftest import CONFIGS, invoke_cli
from tests.hf.test_hf_families import DEEPSEEK, GPT2_SHAPE, SHAPE, VOCAB, _tokens, random_model
from tests.tolerances import PARITY_LOGITS_ABS

transformers = pytest.importorskip("transformers")

TWO_LAYERS = dict(SHAPE, num_hidden_layers=2)


def _saved(cls: str, keys: dict, to: Path) -> torch.nn.Module:
    model = random_model(cls, keys)
    model.save_pretrained(to)
    return model


def _with_head(hf_dir: Path, head: torch.Tensor) -> None:
    """hf_dir's weights with `head` as lm_head.weight (save_pretrained of a tied model has none)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["lm_head.weight"] = head.contiguous()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_tied_config_with_a_distinct_lm_head_imports_untied_with_transformers_logits(
    tmp_path,
):
    """transformers 5 ties lm_head.weight to the embedding only when the file's two are equal;
    a distinct one is the model's output layer (and a warning): so is it ours, with a note."""
    keys = dict(TWO_LAYERS, head_dim=12, tie_word_embeddings=True)
    hf_dir = tmp_path / "hf"
    _saved("Qwen3ForCausalLM", keys, hf_dir)
    _with_head(hf_dir, 0.1 * torch.randn(VOCAB, SHAPE["hidden_size"]))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager"
    ).eval()
    assert theirs.lm_head.weight.data_ptr() != theirs.model.embed_tokens.weight.data_ptr()
    result = invoke_cli("import", "--hf", str(hf_dir), "--output", str(tmp_path / "ours"))
    assert result.returncode == 0, result.stderr
    assert _one_line(result.stderr) == (
        f"note: {hf_dir / 'config.json'}: tie_word_embeddings is true but lm_head.weight "
        "differs from model.embed_tokens.weight; imported untied (model.tie_embeddings false), "
        "as transformers loads it"
    )
    ours = load_model(tmp_path / "ours")
    assert not ours.config.model.tie_embeddings
    with torch.no_grad():
        assert (ours(_tokens()) - theirs(_tokens()).logits).abs().max() < PARITY_LOGITS_ABS
    # training from the directory reads it alike (the same read_hf): an untied model
    assert not read_hf(hf_dir)[0]["tie_embeddings"]


def test_a_tied_config_whose_lm_head_equals_the_embedding_stays_tied(tmp_path):
    hf_dir = tmp_path / "hf"
    model = _saved(
        "Qwen3ForCausalLM", dict(TWO_LAYERS, head_dim=12, tie_word_embeddings=True), hf_dir
    )
    _with_head(hf_dir, model.model.embed_tokens.weight.detach().clone())
    notes: list[str] = []
    fields, source = read_hf(hf_dir, notes)
    assert fields["tie_embeddings"] and notes == []
    assert "lm_head.weight" not in source.tensors


@pytest.mark.parametrize(
    ("cls", "keys", "named"),
    [
        (
            "MixtralForCausalLM",
            dict(TWO_LAYERS, num_local_experts=3, num_experts_per_tok=2, router_jitter_noise=0.1),
            "router_jitter_noise 0.1 is training-time noise that megatronish does not apply "
            "(the weights are the model's)",
        ),
        (
            "LlamaForCausalLM",
            dict(TWO_LAYERS, attention_dropout=0.25),
            "attention_dropout 0.25 is training-time noise that megatronish does not apply "
            "(the weights are the model's; dropout is model.dropout)",
        ),
        (  # GPT2Config's defaults
            "GPT2LMHeadModel",
            dict(GPT2_SHAPE, n_layer=2),
            "resid_pdrop 0.1, embd_pdrop 0.1, attn_pdrop 0.1 are training-time noise",
        ),
    ],
)
def test_training_time_noise_in_config_json_is_one_note_at_import_and_at_init_from_hf(
    cls, keys, named, tmp_path, capsys
):
    hf_dir = tmp_path / "hf"
    _saved(cls, keys, hf_dir)
    result = invoke_cli("import", "--hf", str(hf_dir), "--output", str(tmp_path / "ours"))
    assert result.returncode == 0, result.stderr
    note = _one_line(result.stderr)
    assert note.startswith(f"note: {hf_dir / 'config.json'}: {named}"), note
    cfg, derived = one_process(Checkpoint(tmp_path / "ours").config)
    model = GPT(cfg, derived, ParallelState.single())
    capsys.readouterr()
    init_from_hf(str(hf_dir), model, cfg, derived, main_process=False)
    assert capsys.readouterr().err == ""
    init_from_hf(str(hf_dir), model, cfg, derived)
    assert capsys.readouterr().err.strip() == note


# configs/tiny-qwen3.yaml's model with 7 settings of another: what a new user starts from
OTHER_QWEN3 = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e4,
)  # fmt: skip
DIFFERENCES = (
    "n_layer 4 (model has 2), d_model 128 (model has 64), head_dim 64 (model has 16), "
    "d_ff 384 (model has 96), vocab_size 257 (model has 300), tie_embeddings true (model has "
    "false), rope_theta 1000000.0 (model has 10000.0)"
)
TO_MATCH = (
    "--set model.n_layer=2 --set model.d_model=64 --set model.head_dim=16 --set model.d_ff=96 "
    "--set model.vocab_size=300 --set model.tie_embeddings=false --set model.rope_theta=10000.0"
)


def test_training_from_an_hf_directory_names_every_differing_key_and_the_sets_that_match(
    tmp_path, small_dataset
):
    hf_dir = tmp_path / "hf"
    _saved("Qwen3ForCausalLM", OTHER_QWEN3, hf_dir)
    run = (
        "train", "--config", str(CONFIGS / "tiny-qwen3.yaml"),
        "--set", f"checkpoint.init_from_hf={hf_dir}", "--set", f"data.path={small_dataset}",
        "--set", f"run.out_dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
        "--set", "train.steps=1", "--set", "train.eval_steps=1",
    )  # fmt: skip
    refused = invoke_cli(*run)
    assert refused.returncode == 2, refused.stderr
    assert _one_line(refused.stderr) == (
        f"error: {hf_dir / 'config.json'}: this config differs from the Hugging Face model in "
        f"7 keys: {DIFFERENCES}; to match: {TO_MATCH}"
    )
    started = invoke_cli(*run, *shlex.split(TO_MATCH))
    assert started.returncode == 0, started.stderr
    assert f"initialized from {hf_dir}" in started.stdout


def test_a_deepseek_v3_without_rope_scaling_passes_init_from_hf_with_its_imported_config(
    tmp_path,
):
    """A Moonlight-style config.json (rope_scaling null) imports as model.rope_scaling null;
    the checkpoint's config, read back as a YAML config, keeps it null against the preset's
    YaRN, and so matches the directory it came from."""
    hf_dir = tmp_path / "hf"
    keys = {k: v for k, v in DEEPSEEK.items() if k != "rope_parameters"}
    _saved("DeepseekV3ForCausalLM", dict(keys, num_hidden_layers=2), hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    (hf_dir / "config.json").write_text(json.dumps(dict(config, rope_scaling=None, rope_theta=1e4)))
    result = invoke_cli("import", "--hf", str(hf_dir), "--output", str(tmp_path / "ours"))
    assert result.returncode == 0, result.stderr
    step_dir = Checkpoint(tmp_path / "ours").dir
    assert "rope_scaling: null" in (step_dir / "config.yaml").read_text()
    cfg = load_config(step_dir / "config.yaml")
    assert cfg.model.arch == "deepseek_v3" and cfg.model.rope_scaling is None
    check_hf_matches(read_hf(hf_dir)[0], cfg, derive(cfg, 1), hf_dir)
