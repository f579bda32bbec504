"""model.arch is a preset: it fills the component keys a config leaves unset, and a family's
model is the model of its components (never a branch of its own)."""

from __future__ import annotations

import pytest
import torch

from megatronish.config import MoEConfig, derive, load_config
from megatronish.config.components import GEMMA3, QWEN3_5, ROPE
from megatronish.config.presets import FAMILY_BLOCKS, PRESETS, with_preset
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.model import GPT
from tests.conftest import CONFIGS
from tests.tolerances import EXACT

TINY = CONFIGS / "tiny.yaml"


def test_a_preset_fills_the_component_keys_the_config_leaves_unset():
    cfg = load_config(TINY, ["model.arch=qwen3"])
    assert cfg.model.qk_norm and not cfg.model.qkv_bias
    assert (cfg.model.norm_eps, cfg.model.rope_theta) == (1e-6, 1e6)
    qwen2 = load_config(TINY, ["model.arch=qwen2"]).model
    assert qwen2.qkv_bias and not qwen2.qk_norm
    moe = load_config(TINY, ["model.arch=qwen3_moe"]).model.moe
    assert (moe.router, moe.aux_loss_coef, moe.z_loss_coef) == ("softmax_topk", 0.001, 0.0)


def test_a_key_set_in_the_file_or_by_set_wins_over_the_preset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  arch: qwen3\n  rope_theta: 5000.0\n  moe:\n    top_k: 1\n")
    cfg = load_config(path, ["model.qk_norm=false"])
    assert cfg.model.rope_theta == 5000.0 and not cfg.model.qk_norm
    assert cfg.model.norm_eps == 1e-6 and cfg.model.moe.top_k == 1
    path.write_text("model:\n  arch: qwen3_moe\n  moe:\n    z_loss_coef: 0.5\n")
    moe = load_config(path).model.moe
    assert (moe.z_loss_coef, moe.aux_loss_coef) == (0.5, 0.001)


def test_an_arch_that_is_no_name_is_one_user_error_naming_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  arch: [qwen2]\n")
    with pytest.raises(UserError, match="model.arch"):
        load_config(path)


def test_the_last_arch_given_chooses_the_preset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  arch: qwen3\n")
    cfg = load_config(path, ["model.arch=llama"])
    assert cfg.model.arch == "llama" and not cfg.model.qk_norm and cfg.model.norm_eps == 1e-5


LLAMA_BLOCKS = sorted(a for a in PRESETS if FAMILY_BLOCKS[a] == ROPE and a != "llama")


@pytest.mark.parametrize("arch", LLAMA_BLOCKS)
def test_a_family_is_the_llama_block_with_its_presets_components(arch):
    sets = ["train.seq_len=16", "model.max_seq_len=16", "model.vocab_size=64"]
    if arch.endswith("moe"):
        sets += ["model.moe.num_experts=4", "model.moe.top_k=2"]
    if arch == "deepseek_v3":  # latent attention of small sizes, 16 experts in its 8 groups
        sizes = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4)
        sets += [f"model.mla.{k}={v}" for k, v in sizes.items()]
        sets += ["model.n_layer=4", "model.moe.num_experts=16", "model.moe.d_ff=32"]
    else:
        sets.append("model.n_kv_head=2")
    family = load_config(TINY, [*sets, f"model.arch={arch}"])
    components = [
        f"model.{key}.{k}={v}" if isinstance(value, dict) else f"model.{key}={value}"
        for key, value in PRESETS[arch].items()
        for k, v in (value.items() if isinstance(value, dict) else [(None, None)])
    ]
    llama = load_config(TINY, ["model.arch=llama", *components, *sets])
    models = []
    for cfg in (family, llama):
        torch.manual_seed(0)
        models.append(GPT(cfg, derive(cfg, 1), ParallelState.single()))
    theirs = models[1].state_dict()
    assert {k: v.shape for k, v in models[0].state_dict().items()} == {
        k: v.shape for k, v in theirs.items()
    }
    tokens = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(models[0](tokens), models[1](tokens), rtol=EXACT, atol=EXACT)


MAPPINGS = [
    (arch, key)
    for arch, preset in sorted(PRESETS.items())
    for key, value in preset.items()
    if isinstance(value, dict)
]


@pytest.mark.parametrize(("arch", "key"), MAPPINGS)
def test_a_key_the_file_sets_to_null_keeps_null_for_every_mapping_a_preset_fills(arch, key):
    assert with_preset({"arch": arch, key: None}, arch)[key] is None
    assert with_preset({"arch": arch, key: {}}, arch)[key] == PRESETS[arch][key]


def test_deepseek_v3_with_rope_scaling_null_in_the_file_has_no_rope_scaling(tmp_path):
    """As `--set model.rope_scaling=null` gives (a Moonlight-style model, imported); a section
    that cannot be null (model.moe) is the schema's, as with no preset."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  arch: deepseek_v3\n  rope_scaling: null\n  moe: null\n")
    cfg = load_config(path)
    assert cfg.model.rope_scaling is None and cfg.model.moe == MoEConfig()
    by_set = load_config(None, ["model.arch=deepseek_v3", "model.rope_scaling=null"])
    assert by_set.model.rope_scaling is None
    path.write_text("model:\n  arch: deepseek_v3\n  mla: null\n")
    with pytest.raises(UserError, match="^model.mla.kv_lora_rank: missing"):
        load_config(path)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3"])
def test_a_familys_output_layer_and_mlp_size_defaults_are_its_components(arch):
    sets = [f"model.arch={arch}", "model.n_head=4", "model.d_model=96", "model.vocab_size=61"]
    cfg = load_config(TINY, sets)
    components, derived = FAMILY_BLOCKS[arch], derive(cfg, 1)
    assert cfg.model.tie_embeddings is None and cfg.model.d_ff is None
    assert derived.tie_embeddings == components.tied_output == (arch == "gpt2")
    gelu_size = 4 * cfg.model.d_model
    assert (derived.d_ff == gelu_size) == (not components.gated_mlp)


def test_qwen3_5_fills_transformers_qwen3_5_text_config_defaults_and_its_components():
    from transformers import Qwen3_5TextConfig

    theirs = Qwen3_5TextConfig()
    model = load_config(TINY, ["model.arch=qwen3_5"]).model
    assert (model.norm_eps, model.head_dim) == (theirs.rms_norm_eps, theirs.head_dim)
    rope = theirs.rope_parameters
    assert model.rope_theta == rope["rope_theta"]
    assert model.partial_rotary_factor == rope["partial_rotary_factor"] == 0.25
    assert model.qk_norm and not model.qkv_bias
    assert model.tie_embeddings is theirs.tie_word_embeddings is False
    assert model.components == QWEN3_5
    assert (QWEN3_5.norm_offset, QWEN3_5.attention_gate) == (1.0, True)
    assert all(not FAMILY_BLOCKS[a].attention_gate for a in PRESETS if a != "qwen3_5")


def test_gemma3_fills_transformers_gemma3_text_config_defaults_and_its_components():
    from transformers import Gemma3TextConfig

    theirs = Gemma3TextConfig()
    model = load_config(TINY, ["model.arch=gemma3"]).model
    assert (model.norm_eps, model.head_dim) == (theirs.rms_norm_eps, theirs.head_dim)
    assert model.query_pre_attn_scalar == theirs.query_pre_attn_scalar
    rope = theirs.rope_parameters
    assert model.rope_theta == rope["full_attention"]["rope_theta"]
    assert model.rope_local_base_freq == rope["sliding_attention"]["rope_theta"]
    assert model.attn_logit_softcapping is theirs.attn_logit_softcapping is None
    assert model.final_logit_softcapping is theirs.final_logit_softcapping is None
    assert model.qk_norm and model.components == GEMMA3 and GEMMA3.tied_output
    assert (GEMMA3.norm_placement, GEMMA3.mlp, GEMMA3.norm_offset) == ("sandwich", "geglu", 1.0)
    assert all(not FAMILY_BLOCKS[a].embedding_scale for a in PRESETS if a != "gemma3")


def test_qwen3_5_is_the_llama_block_with_a_gate_per_query_head_and_zero_centered_norms():
    """Its tensors are the llama block's with the preset's keys, but for the qkv rows (a gate
    of head_dim per query head) and its norms' weights (0, scaling by 1 + weight)."""
    sets = ["train.seq_len=16", "model.max_seq_len=16", "model.vocab_size=64"]
    sets += ["model.n_kv_head=2", "model.head_dim=16"]
    family = load_config(TINY, [*sets, "model.arch=qwen3_5"])
    keys = ["model.qk_norm=true", "model.partial_rotary_factor=0.25", "model.norm_eps=1e-6"]
    llama = load_config(TINY, ["model.arch=llama", *keys, *sets])
    ours, theirs = (
        GPT(cfg, derive(cfg, 1), ParallelState.single()).state_dict() for cfg in (family, llama)
    )
    assert sorted(ours) == sorted(theirs)
    gates = family.model.n_head * 16
    for name, tensor in ours.items():
        rows = theirs[name].shape[0] + (gates if name.endswith("attn.qkv.weight") else 0)
        assert tensor.shape == (rows, *theirs[name].shape[1:]), name
        if "norm" in name:
            assert not tensor.any() and theirs[name].eq(1).all(), name
