"""Qwen3-Next (Qwen3NextForCausalLM) from transformers' side, as Qwen3.5 in test_hf_qwen3_5.py:
a tiny random model (3 Gated DeltaNet blocks to 1 full attention, 4 experts with a gated shared
expert, block 0 a dense MLP) imported with our CLI gives transformers' logits; exporting the
import gives back save_pretrained's tensors bit for bit (the fused in_proj_qkvz and in_proj_ba
too), which transformers loads as Qwen3NextForCausalLM with our logits."""

from __future__ import annotations

import json

import pytest
import torch

from megatronish import load_model
from tests.conftest import CONFIGS, invoke_cli
from tests.hf.test_hf_families import random_model
from tests.hf.test_hf_qwen3_5 import HYBRID, _build, _tokens, check_round_trip, relative
from tests.tolerances import PARITY_REL

transformers = pytest.importorskip("transformers")

NEXT = dict(  # 4 experts (top 2) of 20, a shared expert of 40 (2 x 20); block 0 dense (56)
    HYBRID,
    linear_num_value_heads=6,  # 3 value heads per key head
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=40,
    mlp_only_layers=[0],
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("qwen3_next"), "Qwen3NextForCausalLM", NEXT)


def test_a_qwen3_next_model_round_trips_with_transformers_logits(built):
    model = load_model(built[2]).config.model
    assert model.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (model.moe.first_k_dense, model.moe.every, model.d_ff) == (1, 1, 56)
    assert (model.moe.num_experts, model.moe.n_shared_experts) == (4, 2)
    check_round_trip(built)


def test_the_qwen3_next_export_writes_its_dense_blocks_as_mlp_only_layers(built):
    config = json.loads((built[3] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert (config["mlp_only_layers"], config["decoder_sparse_step"]) == ([0], 1)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        (dict(mlp_only_layers=[1]), "mlp_only_layers"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_experts=0), "num_experts"),
    ],
)
def test_a_qwen3_next_setting_we_cannot_express_is_exit_2_in_one_line(
    built, changes, key, tmp_path
):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((built[1] / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, **changes)))
    (hf / "model.safetensors").symlink_to(built[1] / "model.safetensors")
    result = invoke_cli("import", "--hf", str(hf), "--output", str(tmp_path / "ours"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "supported: " in lines[0], lines
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize(
    ("sets", "architecture"),
    [([], "Qwen3_5MoeForCausalLM"), (["model.moe.first_k_dense=1"], "Qwen3NextForCausalLM")],
)
def test_export_writes_a_qwen3_5_model_with_dense_blocks_beside_experts_as_qwen3_next(
    sets, architecture
):
    from megatronish.config import derive, load_config
    from megatronish.hf.registry import family_of_model

    experts = ["model.arch=qwen3_5", "model.moe.num_experts=4", "model.moe.d_ff=16"]
    cfg = load_config(CONFIGS / "tiny.yaml", [*experts, *sets, "model.vocab_size=64"])
    assert family_of_model(cfg, derive(cfg, 1)).architecture == architecture


def test_a_qwen3_next_model_with_experts_in_every_block_exports_as_qwen3_5_moe_with_its_logits(
    tmp_path,
):
    """The published shape (decoder_sparse_step 1, mlp_only_layers []), its config.json giving
    full_attention_interval in place of layer_types: the same model as Qwen3_5MoeForCausalLM."""
    model = random_model("Qwen3NextForCausalLM", dict(NEXT, mlp_only_layers=[]))
    hf, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    model.save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    del config["layer_types"]
    (hf / "config.json").write_text(json.dumps(dict(config, full_attention_interval=4)))
    for args in (("import", "--hf", hf), ("export", "--checkpoint", ours)):
        output = ours if args[0] == "import" else back
        result = invoke_cli(*map(str, args), "--output", str(output))
        assert result.returncode == 0, result.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    assert type(loaded).__name__ == "Qwen3_5MoeForCausalLM"
    with torch.no_grad():
        want, got = model(_tokens()).logits, load_model(ours)(_tokens())
        assert relative(got, want) < PARITY_REL
        assert relative(loaded.eval()(_tokens()).logits, got) < PARITY_REL
