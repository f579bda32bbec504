"""Qwen3.5 (Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM, the text models) from transformers'
side, as every family in test_hf_families.py: a tiny random model built by transformers (fp32,
eager attention, every weight random, norms too; all full attention, and a hybrid of Gated
DeltaNet blocks beside a full one) imported with our CLI gives transformers' logits at tp 1 and
loaded at tp 2; exporting the import gives back save_pretrained's tensors bit for bit, which
transformers loads as the same class with our logits. config.json is read as
Qwen3_5TextConfig fills it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatronish import load_model
from megatronish.errors import UserError
from megatronish.hf import qwen3_5, qwen3_5_moe
from megatronish.hf.family import ConfigJson
from tests.checkpoints import logits_at_tp
from tests.conftest import CONFIGS, invoke_cli
from tests.hf.test_hf_families import random_model
from tests.ranks import run_on_ranks
from tests.tolerances import FP32_REORDER, PARITY_REL

transformers = pytest.importorskip("transformers")

VOCAB = 101
# The published configs' rope_parameters: mrope sections (the same for text positions) beside
# the partial rotary factor; 4 of each head's 16 dims rotate.
ROPE = dict(
    rope_type="default",
    rope_theta=1e7,
    partial_rotary_factor=0.25,
    mrope_section=[1, 1, 0],
    mrope_interleaved=True,
)
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters=ROPE,
    layer_types=["full_attention"] * 3,
)
# Qwen3.5-MoE: 4 experts (top 2) of 20 in every block, and a shared expert of 40 (2 x 20)
# under its sigmoid gate.
MOE = dict(
    SHAPE,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=40,
)
MOE_OURS = dict(num_experts=4, top_k=2, d_ff=20, n_shared_experts=2, shared_expert_gate=True)
CLASSES = {"dense": ("Qwen3_5ForCausalLM", SHAPE), "moe": ("Qwen3_5MoeForCausalLM", MOE)}
HYBRID = dict(  # 3 Gated DeltaNet layers to 1 full attention, as the published models
    SHAPE,
    num_hidden_layers=4,
    layer_types=None,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the largest logit (these reach ~4, not ~1)."""
    return float((got - want).abs().max() / want.abs().max())


def _cli(*args: str) -> None:
    result = invoke_cli(*args)
    assert result.returncode == 0, result.stderr


def _build(root: Path, cls: str, keys: dict) -> tuple[torch.nn.Module, Path, Path, Path]:
    model = random_model(cls, keys)
    hf, ours, back = root / "hf", root / "ours", root / "back"
    model.save_pretrained(hf)
    _cli("import", "--hf", str(hf), "--output", str(ours))
    _cli("export", "--checkpoint", str(ours), "--output", str(back))
    return model, hf, ours, back


@pytest.fixture(scope="module", params=sorted(CLASSES))
def built(request, tmp_path_factory):
    return _build(tmp_path_factory.mktemp(f"qwen3_5-{request.param}"), *CLASSES[request.param])


def check_round_trip(built) -> None:
    """Import gives transformers' logits; export gives its tensors bit for bit, and loads back
    as Qwen3_5ForCausalLM with our logits."""
    from safetensors.torch import load_file

    model, hf, ours, back = built
    with torch.no_grad():
        want, got = model(_tokens()).logits, load_model(ours)(_tokens())
    assert relative(got, want) < PARITY_REL
    theirs = load_file(str(hf / "model.safetensors"))
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(again[key], tensor), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    assert type(loaded).__name__ == type(model).__name__
    with torch.no_grad():
        assert relative(loaded.eval()(_tokens()).logits, got) < PARITY_REL


def test_import_export_and_load_back_of_a_qwen3_5_model_agree_with_transformers(built):
    model = load_model(built[2]).config.model
    assert (model.arch, model.head_dim, model.partial_rotary_factor) == ("qwen3_5", 16, 0.25)
    assert (model.rope_theta, model.qk_norm, model.tie_embeddings) == (1e7, True, False)
    experts = "Moe" in type(built[0]).__name__
    for key, value in (MOE_OURS if experts else dict(num_experts=0)).items():
        assert getattr(model.moe, key) == value, key
    check_round_trip(built)


def test_the_qwen3_5_import_loaded_at_tp2_gives_the_tp1_and_transformers_logits(built):
    """tp 2 splits the kv groups, each with its query heads and their gates (and the experts and
    the shared expert as any MLP)."""
    model, _, ours, _ = built
    at_tp2 = run_on_ranks(logits_at_tp, 2, [str(ours)], _tokens(), timeout=180)[0][0]
    with torch.no_grad():
        at_tp1, want = load_model(ours)(_tokens()), model(_tokens()).logits
    assert relative(at_tp2, at_tp1) < FP32_REORDER
    assert relative(at_tp2, want) < PARITY_REL


def test_a_hybrid_qwen3_5_model_round_trips_with_transformers_logits(tmp_path):
    check_round_trip(_build(tmp_path, "Qwen3_5ForCausalLM", HYBRID))


def test_the_linear_attention_names_are_transformers_gated_deltanet_parameters():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    layer = Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**HYBRID), layer_idx=0)
    mapped = [name for _, name in qwen3_5.LINEAR_ATTENTION]
    theirs = sorted([*mapped, qwen3_5.LINEAR_QKV, qwen3_5.LINEAR_CONV])
    assert theirs == sorted(f"linear_attn.{name}" for name in layer.state_dict())


def _fields(config: dict, family=qwen3_5) -> dict:
    return family.model_fields(ConfigJson(config, Path("config.json")))


def test_a_config_json_without_optional_keys_reads_qwen3_5_text_configs_defaults():
    keys = dict(SHAPE, layer_types=None, rope_parameters=None, head_dim=None)
    keys = {k: v for k, v in keys.items() if v is not None and k != "max_position_embeddings"}
    theirs = transformers.Qwen3_5TextConfig(**keys, layer_types=["full_attention"] * 3)
    fields = _fields(dict(keys, layer_types=["full_attention"] * 3))
    assert fields["head_dim"] == theirs.head_dim == 256
    assert fields["partial_rotary_factor"] == theirs.rope_parameters["partial_rotary_factor"]
    assert fields["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert fields["max_seq_len"] == theirs.max_position_embeddings
    assert (fields["n_kv_head"], fields["norm_eps"]) == (theirs.num_key_value_heads, 1e-6)


LINEAR_REFUSED = [
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "layer_types"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
]


REFUSED = [(qwen3_5, SHAPE, changes, key) for changes, key in LINEAR_REFUSED]
REFUSED += [  # a shared expert our n_shared_experts x moe.d_ff cannot size
    (qwen3_5_moe, MOE, dict(shared_expert_intermediate_size=30), "shared_expert_intermediate"),
    (qwen3_5_moe, MOE, dict(attention_bias=True), "attention_bias"),
]


@pytest.mark.parametrize(("family", "shape", "changes", "key"), REFUSED)
def test_a_qwen3_5_config_json_setting_we_do_not_implement_is_refused_naming_it(
    family, shape, changes, key
):
    config = {k: v for k, v in (shape | changes).items() if v is not None}
    with pytest.raises(UserError) as error:
        _fields(config, family)
    message = str(error.value)
    assert message.startswith("config.json: ") and key in message and "supported: " in message


def test_export_of_a_partial_rope_in_a_family_without_it_is_exit_2_in_one_line(tmp_path):
    sets = ["model.arch=llama", "model.partial_rotary_factor=0.5", "train.steps=1"]
    sets += [f"checkpoint.dir={tmp_path / 'ckpt'}", f"run.out_dir={tmp_path / 'run'}"]
    sets += ["train.eval_every=0", "model.n_layer=1"]
    args = [a for s in sets for a in ("--set", s)]
    assert invoke_cli("train", "--config", str(CONFIGS / "tiny.yaml"), *args).returncode == 0
    checkpoint = tmp_path / "ckpt"
    result = invoke_cli("export", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "o"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.partial_rotary_factor=0.5" in lines[0], lines
    assert "model.arch qwen3_5" in lines[0] and not (tmp_path / "o").exists()


# tiny-qwen3_5.yaml's 4 blocks as the published hybrids: 3 Gated DeltaNet blocks to 1 full
# attention, 2 key heads of 32 dims and 4 value heads of 32 (whatever the file's layer_types).
TINY_HYBRID = [
    "model.layer_types=[linear_attention, linear_attention, linear_attention, full_attention]",
    "model.linear_num_key_heads=2",
    "model.linear_num_value_heads=4",
    "model.linear_key_head_dim=32",
    "model.linear_value_head_dim=32",
]


@pytest.mark.parametrize("hybrid", [[], TINY_HYBRID], ids=["as written", "hybrid"])
def test_the_tiny_qwen3_5_config_trains_from_the_cli_and_exports_as_transformers_class(
    hybrid, tmp_path
):
    """configs/tiny-qwen3_5.yaml (its 4 blocks as written, and made hybrid), on shorter
    sequences, trains 2 steps (its norms leave zero) and its export gives transformers'
    Qwen3_5ForCausalLM our logits."""
    sets = [*hybrid, "train.seq_len=32", "train.micro_batch_size=2"]
    sets += ["train.global_batch_size=4", "train.steps=2", "train.eval_every=0"]
    sets += [f"checkpoint.dir={tmp_path / 'ckpt'}", f"run.out_dir={tmp_path / 'run'}"]
    args = [a for s in sets for a in ("--set", s)]
    result = invoke_cli("train", "--config", str(CONFIGS / "tiny-qwen3_5.yaml"), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("step 2: loss ")
    _cli("export", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    if hybrid:
        assert loaded.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    norm = loaded.model.layers[0].input_layernorm.weight
    assert norm.abs().max() > 0, "a trained norm's weight"
    ours = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative(loaded(tokens).logits, ours(tokens)) < PARITY_REL


EXPERTS = ["model.arch=qwen3_5", "model.n_kv_head=2", "model.head_dim=8"]
EXPERTS += ["model.moe.num_experts=4", "model.moe.d_ff=16"]


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["model.moe.every=2"], "model.moe.every=2, first_k_dense=0"),
        (["model.moe.shared_expert=false", "model.moe.shared_expert_gate=false"], "shared_expert"),
        (["model.moe.shared_expert_gate=false"], "model.moe.shared_expert_gate=false"),
        (["model.moe.router=sigmoid"], "model.moe.router=sigmoid"),
    ],
)
def test_export_of_experts_qwen3_5_moe_cannot_express_names_the_setting(sets, needle):
    from megatronish.config import derive, load_config
    from megatronish.hf.registry import family_of_model

    cfg = load_config(CONFIGS / "tiny.yaml", [*EXPERTS, *sets, "model.vocab_size=64"])
    derived = derive(cfg, 1)
    dense_blocks = "every" in needle  # export writes those as Qwen3NextForCausalLM
    if not dense_blocks:
        assert family_of_model(cfg, derived) is qwen3_5_moe.FAMILY
    with pytest.raises(UserError) as error:
        qwen3_5_moe.FAMILY.config_json(cfg, derived)
    assert needle in str(error.value) and "Qwen3_5MoeForCausalLM" in str(error.value)


def test_a_shared_expert_gate_without_shared_experts_is_exit_2_in_one_line():
    sets = [*EXPERTS, "model.moe.shared_expert=false"]
    args = [a for s in sets for a in ("--set", s)]
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.moe.shared_expert_gate: true" in lines[0], lines


def test_training_the_preset_from_a_qwen3_5_moe_directory_of_its_sizes_takes_its_weights():
    """The preset's one gated shared expert is the class's shared expert of
    moe_intermediate_size: nothing to --set but the sizes."""
    from megatronish.config import derive, load_config
    from megatronish.hf.importer import check_hf_matches

    fields = _fields(dict(MOE, shared_expert_intermediate_size=20), qwen3_5_moe)
    sets = ["model.arch=qwen3_5", "model.n_layer=3", "model.n_head=6", "model.n_kv_head=2"]
    sets += ["model.d_model=40", "model.head_dim=16", f"model.vocab_size={VOCAB}"]
    sets += ["model.moe.num_experts=4", "model.moe.d_ff=20", "model.rope_theta=1e7"]
    cfg = load_config(None, [*sets, "model.max_seq_len=64", "train.seq_len=16"])
    check_hf_matches(fields, cfg, derive(cfg, 1), Path("hf"))
