"""Gemma 3 (Gemma3ForCausalLM, the text model) from transformers' side, as every family in
test_hf_families.py: a tiny random model built by transformers (fp32, eager attention, every
weight random, norms too; 2 sliding blocks then a global one, the global one's RoPE linearly
scaled, the local ones' of their own base, query_pre_attn_scalar unlike head_dim), with the
soft-caps left out (the published configs) and set, imported with our CLI gives transformers'
logits; exporting the import gives back save_pretrained's tensors bit for bit, which transformers
loads as the same class with our logits. config.json is read as Gemma3TextConfig fills it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatronish import load_model
from megatronish.errors import UserError
from megatronish.hf import gemma3
from megatronish.hf.family import ConfigJson
from tests.conftest import CONFIGS, invoke_cli
from tests.hf.test_hf_families import random_model
from tests.hf.test_hf_qwen3_5 import relative
from tests.tolerances import PARITY_REL

transformers = pytest.importorskip("transformers")

VOCAB = 101
ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=5,  # below the 17 tokens: the window masks
    query_pre_attn_scalar=24,
    rope_parameters=ROPE,
)
# Caps the tiny model's logits (up to ~6) and scores reach: tanh bends them.
SOFTCAPPED = dict(SHAPE, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
MODELS = {"published": SHAPE, "softcapped": SOFTCAPPED}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))


def _cli(*args: str):
    result = invoke_cli(*args)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request, tmp_path_factory):
    """(transformers' model, its directory, our import, our export, import's stderr)."""
    root = tmp_path_factory.mktemp(f"gemma3-{request.param}")
    model = random_model("Gemma3ForCausalLM", MODELS[request.param])
    hf, ours, back = root / "hf", root / "ours", root / "back"
    model.save_pretrained(hf)
    imported = _cli("import", "--hf", str(hf), "--output", str(ours))
    _cli("export", "--checkpoint", str(ours), "--output", str(back))
    return model, hf, ours, back, imported.stderr


def test_import_export_and_load_back_of_a_gemma3_model_agree_with_transformers(built):
    from safetensors.torch import load_file

    model, hf, ours, back, _ = built
    settings = load_model(ours).config.model
    assert settings.arch == "gemma3" and settings.layer_types == SHAPE["layer_types"]
    assert (settings.sliding_window, settings.query_pre_attn_scalar) == (5, 24)
    assert (settings.rope_theta, settings.rope_local_base_freq) == (1e6, 1e4)
    assert settings.rope_scaling.to_dict() == {"type": "linear", "factor": 8.0}
    assert settings.final_logit_softcapping == model.config.final_logit_softcapping
    with torch.no_grad():
        want, got = model(_tokens()).logits, load_model(ours)(_tokens())
    assert relative(got, want) < PARITY_REL
    theirs, again = (load_file(str(d / "model.safetensors")) for d in (hf, back))
    assert sorted(again) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(again[key], tensor), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    assert type(loaded).__name__ == "Gemma3ForCausalLM"
    assert loaded.config.rope_parameters == model.config.rope_parameters
    with torch.no_grad():
        assert relative(loaded.eval()(_tokens()).logits, got) < PARITY_REL


def test_the_attention_soft_cap_gemma3_does_not_apply_is_imported_off_with_a_note(built):
    """transformers' Gemma3Attention reads attn_logit_softcapping but never passes it to its
    attention (Gemma 2's does): the import runs as transformers does, and says so."""
    model, _, ours, _, stderr = built
    assert load_model(ours).config.model.attn_logit_softcapping is None
    if model.config.attn_logit_softcapping is None:
        assert "attn_logit_softcapping" not in stderr
    else:
        (note,) = [line for line in stderr.splitlines() if "attn_logit_softcapping" in line]
        assert note.startswith("note: ") and "imported without it" in note


def _fields(config: dict) -> dict:
    return gemma3.model_fields(ConfigJson(config, Path("config.json")))


def test_a_config_json_without_optional_keys_reads_gemma3_text_configs_defaults():
    keys = {k: v for k, v in SHAPE.items() if k in ("vocab_size", "hidden_size")}
    keys |= dict(intermediate_size=56, num_hidden_layers=7, num_attention_heads=4)
    theirs = transformers.Gemma3TextConfig(**keys)
    fields = _fields(keys)
    assert fields["layer_types"] == theirs.layer_types  # 5 sliding, 1 full, 1 sliding
    assert fields["sliding_window"] == theirs.sliding_window
    assert fields["query_pre_attn_scalar"] == theirs.query_pre_attn_scalar
    assert (fields["head_dim"], fields["n_kv_head"]) == (theirs.head_dim, 4)
    assert fields["rope_theta"] == theirs.rope_parameters["full_attention"]["rope_theta"]
    local = theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert fields["rope_local_base_freq"] == local
    assert fields["tie_embeddings"] is theirs.tie_word_embeddings is True
    assert fields["norm_eps"] == theirs.rms_norm_eps


def test_the_older_rope_keys_read_as_the_per_kind_rope_parameters():
    """Hub configs of transformers 4: rope_theta and rope_scaling (the global blocks'), and
    rope_local_base_freq."""
    old = {k: v for k, v in SHAPE.items() if k != "rope_parameters"}
    old |= dict(rope_theta=1e6, rope_local_base_freq=1e4)
    old["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    assert _fields(old) == _fields(SHAPE)


REFUSED = [
    (dict(layer_types=["full_attention"] * 2), "num_hidden_layers=3"),
    (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (
        dict(rope_parameters={**ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2}}),
        "rope_parameters.sliding_attention",
    ),
]


@pytest.mark.parametrize(("changes", "key"), REFUSED)
def test_a_gemma3_config_json_setting_we_do_not_implement_is_refused_naming_it(changes, key):
    with pytest.raises(UserError) as error:
        _fields(SHAPE | changes)
    message = str(error.value)
    assert message.startswith("config.json: ") and key in message and "supported: " in message


def test_importing_a_layer_pattern_that_does_not_match_the_layers_is_exit_2_in_one_line(
    built, tmp_path
):
    _, hf, _, _, _ = built
    bad = tmp_path / "hf"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(hf / "model.safetensors")
    config = json.loads((hf / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (bad / "config.json").write_text(json.dumps(config))
    result = invoke_cli("import", "--hf", str(bad), "--output", str(tmp_path / "ours"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "layer_types" in lines[0] and "num_hidden_layers=3" in lines[0]
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
@pytest.mark.parametrize("value", ["0", "-2.5"])
def test_a_soft_cap_not_above_zero_is_exit_2_in_one_line_naming_it(key, value):
    args = ["--set", f"model.{key}={value}"]
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny-gemma3.yaml"), *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"model.{key}: {float(value)}" in lines[0], lines
    assert "must be > 0" in lines[0]


def test_export_of_an_attention_soft_cap_gemma3_does_not_apply_names_the_key():
    from megatronish.config import derive, load_config

    sets = ["model.attn_logit_softcapping=50", "model.vocab_size=64"]
    cfg = load_config(CONFIGS / "tiny-gemma3.yaml", sets)
    with pytest.raises(UserError) as error:
        gemma3.FAMILY.config_json(cfg, derive(cfg, 1))
    assert "model.attn_logit_softcapping=50" in str(error.value)
