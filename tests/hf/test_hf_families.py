"""Every Hugging Face family from transformers' side: a tiny random model of each class built by
transformers (fp32, eager attention, odd sizes, every weight random, biases and norms too) and
saved with save_pretrained, imported with our CLI, gives transformers' logits, at tp 1 and
loaded at tp 2; exporting the import gives back save_pretrained's tensors bit for bit, which
transformers loads as the same class. A config.json setting megatronish does not implement is
a UserError naming the file, the key and what is supported (exit 2 in one line from the CLI),
and training from a directory checks every setting the weights depend on."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from megatronish import load_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.cli import cli
from megatronish.config import derive, load_config
from megatronish.errors import UserError
from megatronish.hf.importer import check_hf_matches, import_hf, read_hf
from megatronish.model.mtp import future_tokens_of
from megatronish.objectives.registry import sequence_losses
from tests.checkpoints import logits_at_tp
from tests.conftest import run_cli
from tests.ranks import run_on_ranks
from tests.tolerances import FP32_LOGITS_ABS, PARITY_LOGITS_ABS

transformers = pytest.importorskip("transformers")

VOCAB = 101
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
GPT2_SHAPE = dict(vocab_size=VOCAB, n_embd=40, n_layer=3, n_head=4, n_positions=64, n_inner=56)
EXPERTS = dict(num_experts_per_tok=2)
# Head dim 12 at theta 5e5 over 17 positions: llama3 blends dim pair 0 and slows the others;
# yarn keeps pair 0, ramps pair 1, slows the others and scales cos and sin by 1.14.
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
QWEN_YARN = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16)
# DeepSeek-V3's YaRN: mscale_all_dim scales the softmax too.
DEEPSEEK_YARN = dict(
    rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
    mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0,
)  # fmt: skip
# Latent attention (a query low-rank path or not), a dense block 0, then 8 experts in 4 groups
# (2 chosen) by sigmoid scores with a random correction bias, and two shared experts.
DEEPSEEK = dict(
    SHAPE, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=20, n_shared_experts=2, first_k_dense_replace=1, n_group=4,
    topk_group=2, routed_scaling_factor=1.5, rope_parameters=DEEPSEEK_YARN,
)  # fmt: skip
DEEPSEEK_OURS = dict(arch="deepseek_v3", attention="mla", mtp_depth=0, n_kv_head=None)
# the model.rope_scaling each import must set
SCALINGS = {
    "llama": {**LLAMA3_ROPE, "rope_type": None, "type": "llama3"},
    "qwen3": dict(type="yarn", factor=4.0, original_max_position_embeddings=16),
    **dict.fromkeys(
        ("deepseek_v3", "deepseek_v3_q"),
        dict(type="yarn", factor=4.0, original_max_position_embeddings=16, mscale_all_dim=0.8),
    ),
}
# name -> (class, config keys, our model.* settings the import must set)
FAMILIES = {
    "gpt2": ("GPT2LMHeadModel", GPT2_SHAPE, dict(arch="gpt2", head_dim=None)),
    "llama": (  # Llama 3.1's RoPE scaling (bands cut at a tiny context); config.json rewritten
        "LlamaForCausalLM",  # as Llama 3.1's: rope_theta beside rope_scaling
        dict(SHAPE, head_dim=12, rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5}),
        dict(arch="llama", head_dim=12, rope_theta=5e5, qkv_bias=False, qk_norm=False),
    ),
    "mistral": (  # a window of 5 of the 17 positions in every block
        "MistralForCausalLM",
        dict(SHAPE, sliding_window=5),
        dict(arch="mistral", head_dim=10, qkv_bias=False, qk_norm=False, sliding_window=5),
    ),
    "qwen2": (  # block 0 attends fully, blocks 1 and 2 through a window of 5
        "Qwen2ForCausalLM",
        dict(
            SHAPE,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        ),
        dict(
            arch="qwen2",
            head_dim=10,
            qkv_bias=True,
            qk_norm=False,
            tie_embeddings=True,
            sliding_window=5,
            full_attention_layers=1,
        ),
    ),
    "qwen3": (  # Qwen's YaRN long-context scaling
        "Qwen3ForCausalLM",
        dict(SHAPE, head_dim=12, tie_word_embeddings=True, rope_parameters=QWEN_YARN),
        dict(arch="qwen3", head_dim=12, qkv_bias=False, qk_norm=True, tie_embeddings=True),
    ),
    "qwen3_moe": (  # experts in blocks 0 and 2 (block 1 dense): model.moe.every 2
        "Qwen3MoeForCausalLM",
        dict(
            SHAPE,
            **EXPERTS,
            head_dim=12,
            num_experts=3,
            moe_intermediate_size=20,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        dict(arch="qwen3_moe", head_dim=12, qkv_bias=False, qk_norm=True),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        dict(SHAPE, **EXPERTS, num_local_experts=3),
        dict(arch="llama", head_dim=10, qkv_bias=False, qk_norm=False),
    ),
    "deepseek_v3": ("DeepseekV3ForCausalLM", DEEPSEEK, DEEPSEEK_OURS),
    "deepseek_v3_q": ("DeepseekV3ForCausalLM", dict(DEEPSEEK, q_lora_rank=None), DEEPSEEK_OURS),
}
DEEPSEEK_MOE = dict(
    num_experts=8, top_k=2, d_ff=20, router="sigmoid", n_group=4, topk_group=2,
    routed_scaling_factor=1.5, n_shared_experts=2, first_k_dense=1,
)  # fmt: skip
MOE = {
    "qwen3_moe": dict(num_experts=3, top_k=2, d_ff=20, every=2),
    "mixtral": dict(every=1),
    "deepseek_v3": DEEPSEEK_MOE,
    "deepseek_v3_q": DEEPSEEK_MOE,
}


@dataclass
class Built:
    """A family's transformers model and the directories made of it: save_pretrained's, our
    import of it, and our export of that."""

    model: torch.nn.Module
    hf: Path
    ours: Path
    back: Path


def _random_model(name: str) -> torch.nn.Module:
    """The family's tiny model with every weight random (biases and norm weights init to 0 and
    1, and the router to 0: each must show in the logits), DeepSeek's routing bias too."""
    cls, keys, _ = FAMILIES[name]
    return random_model(cls, keys)


def random_model(cls: str, keys: dict) -> torch.nn.Module:
    """transformers' model of class `cls` and config keys `keys` (fp32, eager attention), every
    weight random as _random_model makes them (the config: the family's text config where it
    has one, as Qwen3_5ForCausalLM takes Qwen3_5TextConfig)."""
    family = cls.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
    config_class = getattr(transformers, family + "TextConfig", None)
    config_class = config_class or getattr(transformers, family + "Config")
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config_class(**keys, attn_implementation="eager")).eval()
    with torch.no_grad():
        for param in model.parameters():
            vector = param.dim() == 1  # a bias or a norm's weight
            param.normal_(1.0 if vector else 0.0, 0.5 if vector else 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def _as_llama31(hf_dir: Path) -> None:
    """config.json with Llama 3.1's RoPE keys: rope_theta beside rope_scaling."""
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    (hf_dir / "config.json").write_text(json.dumps(config))


def _cli(*args: str) -> None:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Built]:
    root = tmp_path_factory.mktemp("hf-families")
    out = {}
    for name in FAMILIES:
        model = _random_model(name)
        paths = [root / name, root / f"{name}-ours", root / f"{name}-back"]
        model.save_pretrained(paths[0])
        if name == "llama":
            _as_llama31(paths[0])
        _cli("import", "--hf", str(paths[0]), "--output", str(paths[1]))
        _cli("export", "--checkpoint", str(paths[1]), "--output", str(paths[2]))
        out[name] = Built(model, *paths)
    return out


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def want(built) -> dict[str, torch.Tensor]:
    """transformers' logits of each family's model."""
    with torch.no_grad():
        return {name: b.model(_tokens()).logits for name, b in built.items()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_our_import_of_a_transformers_model_gives_its_logits(name, built, want):
    ours = load_model(built[name].ours)
    model = ours.config.model
    for key, value in FAMILIES[name][2].items():
        assert getattr(model, key) == value, key
    for key, value in MOE.get(name, dict(num_experts=0)).items():
        assert getattr(model.moe, key) == value, key
    scaling, want_scaling = model.rope_scaling, SCALINGS.get(name)
    assert (scaling is None) == (want_scaling is None), scaling
    for key, value in (want_scaling or {}).items():
        assert getattr(scaling, key, None) == value, key
    with torch.no_grad():
        assert (ours(_tokens()) - want[name]).abs().max() < PARITY_LOGITS_ABS


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_export_of_the_import_gives_back_the_transformers_tensors_bit_for_bit(name, built):
    from safetensors.torch import load_file

    theirs = load_file(str(built[name].hf / "model.safetensors"))
    back = load_file(str(built[name].back / "model.safetensors"))
    assert sorted(back) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_transformers_loads_our_export_as_the_family_class_with_our_logits(name, built):
    back = transformers.AutoModelForCausalLM.from_pretrained(
        built[name].back, attn_implementation="eager"
    ).eval()
    assert type(back).__name__ == FAMILIES[name][0]
    with torch.no_grad():
        ours = load_model(built[name].ours)(_tokens())
        assert (back(_tokens()).logits - ours).abs().max() < PARITY_LOGITS_ABS


def test_every_imported_family_loaded_at_tp2_gives_the_tp1_logits(built, want):
    """One two-rank run loads every family's import at tp 2 (heads, kv heads, MLPs, experts and
    the vocab split over the ranks): its logits are tp 1's to fp32 rounding."""
    names = sorted(FAMILIES)
    paths = [str(built[name].ours) for name in names]
    at_tp2 = run_on_ranks(logits_at_tp, 2, paths, _tokens(), timeout=180)[0]
    for name, logits in zip(names, at_tp2, strict=True):
        with torch.no_grad():
            at_tp1 = load_model(built[name].ours)(_tokens())
        assert (logits - at_tp1).abs().max() < FP32_LOGITS_ABS, name
        assert (logits - want[name]).abs().max() < PARITY_LOGITS_ABS, name


LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
REMOVED = None  # a key taken out of config.json (its class default applies)


@pytest.mark.parametrize(
    ("name", "changes", "key"),
    [
        ("llama", dict(rope_scaling=dict(LLAMA31_ROPE, rope_type="longrope")), "rope_type"),
        ("llama", dict(rope_scaling=dict(LLAMA31_ROPE, beta_fast=8)), "beta_fast"),
        ("qwen3", dict(rope_parameters=dict(YARN, rope_type="dynamic")), "rope_type"),
        ("llama", dict(hidden_act="gelu"), "hidden_act"),
        ("llama", dict(attention_bias=True), "attention_bias"),
        ("llama", dict(mlp_bias=True), "mlp_bias"),
        ("qwen3", dict(attention_bias=True), "attention_bias"),
        ("mistral", dict(sliding_window=0), "sliding_window"),
        ("mixtral", dict(sliding_window=2.5), "sliding_window"),
        (
            "qwen2",
            dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            "layer_types",
        ),
        ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob"),
        ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[]), "decoder_sparse_step"),
        ("qwen3_moe", dict(mlp_only_layers=[0]), "mlp_only_layers"),
        ("deepseek_v3", dict(topk_method="greedy"), "topk_method"),
        ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func"),
        ("deepseek_v3_q", dict(rope_interleave=False), "rope_interleave"),
        ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights"),
        ("gpt2", dict(activation_function="relu"), "activation_function"),
    ],
)
def test_a_config_json_setting_we_do_not_implement_is_refused_naming_it(
    name, changes, key, built, tmp_path
):
    hf_dir = _config_only(built[name].hf, tmp_path / "hf", changes)
    with pytest.raises(UserError) as error:
        import_hf(str(hf_dir), str(tmp_path / "out"))
    message = str(error.value)
    assert message.startswith(f"{hf_dir / 'config.json'}: ") and f"{key} " in message, message
    assert "supported: " in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def _config_only(hf_dir: Path, to: Path, changes: dict) -> Path:
    """A directory holding hf_dir's config.json with `changes` (None: the key removed)."""
    config = json.loads((hf_dir / "config.json").read_text()) | changes
    to.mkdir()
    (to / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return to


@pytest.mark.parametrize(
    ("name", "changes", "window", "full"),
    [
        ("mistral", dict(sliding_window=REMOVED), 4096, 0),  # MistralConfig's default
        ("mistral", dict(sliding_window=None), None, 0),  # Mistral 7B v0.2 / v0.3
        ("qwen2", dict(use_sliding_window=False), None, 0),  # the window off: every block full
        ("qwen2", dict(layer_types=REMOVED, max_window_layers=2), 5, 2),  # transformers 4's keys
        # Qwen3MoeConfig has no max_window_layers: under use_sliding_window every block slides
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=5, max_window_layers=2), 5, 0),
    ],
)
def test_config_json_window_keys_read_as_transformers_reads_them(
    name, changes, window, full, built, tmp_path
):
    from megatronish.hf.family import ConfigJson
    from megatronish.hf.registry import family_of_config_json

    hf_dir = _config_only(built[name].hf, tmp_path / "hf", changes)
    config = json.loads((hf_dir / "config.json").read_text())
    if name == "mistral" and window is None:
        config["sliding_window"] = None  # written as null, not left out
    fields = family_of_config_json(ConfigJson(config, hf_dir)).model_fields(
        ConfigJson(config, hf_dir)
    )
    assert (fields["sliding_window"], fields["full_attention_layers"]) == (window, full)


def test_cli_import_of_a_rope_scaling_we_do_not_implement_exits_2_in_one_line(built, tmp_path):
    changes = dict(rope_scaling=dict(LLAMA31_ROPE, rope_type="longrope"))
    hf_dir = _config_only(built["llama"].hf, tmp_path / "hf", changes)
    result = run_cli("import", "--hf", str(hf_dir), "--output", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{hf_dir / 'config.json'}: rope_scaling.rope_type 'longrope'" in lines[0]
    assert "llama3" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_import_reads_experts_in_transformers_fused_layout(name, built, tmp_path):
    """A directory holding the model's own state dict (experts as mlp.experts.gate_up_proj and
    down_proj, as from_pretrained reads them too) imports as the Hub's per-expert names do."""
    from safetensors.torch import save_file

    fused = _config_only(built[name].hf, tmp_path / "fused", {})
    state = built[name].model.state_dict()
    assert any(key.endswith("mlp.experts.gate_up_proj") for key in state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))
    import_hf(str(fused), str(tmp_path / "ours"))
    got, expected = Checkpoint(tmp_path / "ours"), Checkpoint(built[name].ours)
    assert sorted(got.specs) == sorted(expected.specs)
    for key in expected.specs:
        assert torch.equal(got.full(key), expected.full(key)), key


@pytest.mark.parametrize(
    ("name", "change", "expected"),
    [
        (
            "qwen3",
            dict(qk_norm=False),
            "in 1 key: qk_norm false (model has true); to match: --set model.qk_norm=true",
        ),
        ("qwen3", dict(head_dim=16), "head_dim 16 (model has 12)"),
        ("qwen2", dict(qkv_bias=False), "qkv_bias false (model has true)"),
        ("qwen2", dict(tie_embeddings=False), "tie_embeddings false (model has true)"),
        ("qwen3_moe", dict(arch="qwen3"), "arch qwen3 (model has qwen3_moe)"),
        ("qwen3_moe", dict(moe_every=1), "moe.every 1 (model has 2)"),
        ("qwen3_moe", dict(moe_d_ff=24), "moe.d_ff 24 (model has 20)"),
        ("mixtral", dict(moe_top_k=1), "moe.top_k 1 (model has 2)"),
        ("llama", dict(rope_theta=1e4), "rope_theta 10000.0 (model has 500000.0)"),
        (  # the --set it names is one --set takes, quoted for a shell
            "llama",
            dict(rope_scaling=None),
            "rope_scaling null (model has {type: llama3, factor: 4.0,",
        ),
        ("mistral", dict(sliding_window=None), "sliding_window null (model has 5)"),
        ("qwen2", dict(full_attention_layers=2), "full_attention_layers 2 (model has 1)"),
        ("deepseek_v3", dict(mla_kv_lora_rank=8), "mla.kv_lora_rank 8 (model has 16)"),
    ],
)
def test_training_from_an_hf_directory_names_any_setting_its_weights_depend_on(
    name, change, expected, built, tmp_path
):
    fields, _ = read_hf(built[name].hf)
    cfg = Checkpoint(built[name].ours).config
    check_hf_matches(fields, cfg, derive(cfg, 1), built[name].hf)  # the import's own: fits
    for key, value in change.items():
        section, _, field = key.partition("_") if key[:4] in ("moe_", "mla_") else ("", "", key)
        setattr(getattr(cfg.model, section) if section else cfg.model, field, value)
    with pytest.raises(
        UserError, match="^" + re.escape(str(built[name].hf / "config.json"))
    ) as error:
        check_hf_matches(fields, cfg, derive(cfg, 1), built[name].hf)
    assert expected in str(error.value)
    sets = shlex.split(str(error.value).partition("; to match: ")[2])  # as a shell reads them
    assert sets[::2] == ["--set"] * (len(sets) // 2)
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg.to_dict()))
    fixed = load_config(changed, sets[1::2])
    check_hf_matches(fields, fixed, derive(fixed, 1), built[name].hf)


def _with_mtp_layer(hf_dir: Path, to: Path, head_copy=None) -> dict[str, torch.Tensor]:
    """hf_dir's DeepSeek-V3 with one multi-token prediction layer, model.layers.3, as the
    published checkpoints store it: enorm, hnorm, eh_proj, a MoE decoder layer (block 2's
    weights, perturbed), shared_head.norm and copies of embed_tokens and lm_head (head_copy:
    another head instead). Returns its tensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    mtp = "model.layers.3."
    for key in [k for k in tensors if k.startswith("model.layers.2.")]:
        t = tensors[key]
        tensors[mtp + key.removeprefix("model.layers.2.")] = t + 0.1 * torch.randn(
            t.shape, generator=gen
        )
    h = SHAPE["hidden_size"]
    for name, shape in (("enorm", (h,)), ("hnorm", (h,)), ("shared_head.norm", (h,))):
        tensors[f"{mtp}{name}.weight"] = 1 + 0.5 * torch.randn(shape, generator=gen)
    tensors[mtp + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    head = tensors["lm_head.weight"] if head_copy is None else head_copy
    tensors[mtp + "shared_head.head.weight"] = head.clone()
    _config_only(hf_dir, to, dict(num_nextn_predict_layers=1))
    save_file(tensors, str(to / "model.safetensors"))
    return tensors


def test_deepseek_multi_token_prediction_layers_travel_as_the_published_checkpoints_store_them(
    built, tmp_path
):
    """A DeepSeek-V3 directory with model.layers.<num_hidden_layers>.* imports with
    model.mtp_depth 1 and those weights in its module (a MoE block); its export writes them
    back bit for bit, which transformers loads (ignoring them) with our logits; a shared head
    copy that differs from the model's is refused."""
    from safetensors.torch import load_file

    tensors = _with_mtp_layer(built["deepseek_v3"].hf, tmp_path / "hf")
    _cli("import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ours"))
    ours = Checkpoint(tmp_path / "ours")
    assert ours.config.model.mtp_depth == 1
    assert torch.equal(
        ours.full("mtp.layers.0.eh_proj.weight"), tensors["model.layers.3.eh_proj.weight"]
    )
    assert torch.equal(
        ours.full("mtp.layers.0.block.mlp.router.bias"),
        tensors["model.layers.3.mlp.gate.e_score_correction_bias"],
    )
    _cli("export", "--checkpoint", str(tmp_path / "ours"), "--output", str(tmp_path / "back"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(tensors)
    for key, tensor in tensors.items():
        assert torch.equal(back[key], tensor), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert (
            model(_tokens()).logits - load_model(tmp_path / "ours")(_tokens())
        ).abs().max() < PARITY_LOGITS_ABS
    _with_mtp_layer(built["deepseek_v3"].hf, tmp_path / "bad", tensors["lm_head.weight"] * 2)
    with pytest.raises(UserError, match="model.layers.3.shared_head.head.weight differs"):
        import_hf(str(tmp_path / "bad"), str(tmp_path / "bad-out"))
    assert not (tmp_path / "bad-out").exists()


def _with_transformers_mtp(main, depth: int, to: Path):
    """transformers' own multi-token prediction (MtpModel) of depth `depth` on the DeepSeek-V3
    model `main`, every weight of its modules random, saved with main's weights in to/ as the
    published checkpoints store the modules (model.layers.<num_hidden_layers + k>.*)."""
    from safetensors.torch import save_file
    from transformers.modeling_layers import MtpModel

    main.config.num_mtp_layers = depth
    mtp = MtpModel(main, depth).eval()
    torch.manual_seed(4)
    tensors = {k: v.contiguous() for k, v in main.state_dict().items()}
    with torch.no_grad():
        for k, layer in enumerate(mtp.layers):
            for param in layer.parameters():
                vector = param.dim() == 1
                param.normal_(1.0 if vector else 0.0, 0.5 if vector else 0.1)
            layer.mtp_block.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
            prefix = f"model.layers.{SHAPE['num_hidden_layers'] + k}."
            for name, value in layer.state_dict().items():
                name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
                tensors[prefix + name] = value.clone()
            tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    main.save_pretrained(to)
    save_file(tensors, str(to / "model.safetensors"))
    return mtp


def test_deepseek_multi_token_prediction_gives_transformers_mtp_logits_and_loss(tmp_path):
    """transformers' MtpModel (depth 2) feeds module 1 the main model's last hidden state after
    its final norm and module k + 1 module k's normed output, with the tokens k ahead at the
    main model's positions: our import of its weights gives each depth's logits and the mean
    of the depths' cross-entropies on the targets k + 1 ahead (fp32: to 1e-5)."""
    main = _random_model("deepseek_v3")
    mtp = _with_transformers_mtp(main, 2, tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    gpt = load_model(tmp_path / "ours").gpt
    assert gpt.cfg.model.mtp_depth == 2
    sequence = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(5))
    tokens, targets, s = sequence[:, :-1], sequence[:, 1:], 17
    positions = torch.arange(s).expand(2, s)
    with torch.no_grad():
        outputs = main.model(tokens, output_hidden_states=True)
        assert torch.equal(outputs.hidden_states[-1], outputs.last_hidden_state)
        hidden, theirs, losses = outputs.hidden_states[-1], [], []
        for k in range(1, 3):
            ahead = torch.cat([tokens[:, k:], torch.zeros_like(tokens[:, :k])], dim=1)
            hidden = mtp.forward_layer(k - 1, hidden, positions, None, input_ids=ahead)
            theirs.append(mtp._project_to_logits(hidden))
            want = torch.cat([targets[:, k:], torch.full_like(targets[:, :k], -100)], dim=1)
            losses.append(torch.nn.functional.cross_entropy(theirs[-1].transpose(1, 2), want))
        gpt.train()
        ours = sequence_losses(gpt, tokens, targets)
        embedded = gpt.tok_emb(future_tokens_of(tokens, targets, 2)[:, 0])
        normed = gpt.mtp(gpt.norm_f(gpt.stage_forward(tokens)), embedded, None, None)
    for depth, (x, want_logits) in enumerate(zip(normed, theirs, strict=True)):
        assert (gpt.logits(x)[..., :VOCAB] - want_logits).abs().max() < FP32_LOGITS_ABS, depth
    assert abs(ours.mtp - torch.stack(losses).mean()) < FP32_LOGITS_ABS
