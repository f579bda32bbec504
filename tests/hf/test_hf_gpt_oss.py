"""GPT-OSS (GptOssForCausalLM) from transformers' side: a tiny random model (fp32, eager
attention, every weight random, sinks and biases too; sliding blocks of window 4 beside full
ones on 17 tokens, YaRN) imported with our CLI gives transformers' logits; exporting the import
gives back save_pretrained's tensors bit for bit, but for the experts' gate_up_proj and down_proj:
those in bf16 (the published checkpoints' MXFP4 is not written), their bf16 roundings exactly,
with one line saying so and a config.json without quantization_config. transformers loads the
export with our logits within the bf16 experts' bound, and with the logits of the export imported
again (the bf16 experts exactly, in fp32) within PARITY_REL. A
checkpoint whose experts are MXFP4 blocks and scales, in the published layout, imports as
transformers dequantizes it, bit for bit. The clamped SwiGLU is GptOssExperts' gate, bit for bit
forward and backward.

transformers' own MXFP4 quantizer (quantize_to_mxfp4) needs the triton_kernels hub package,
which is GPU-only and not installed here: the packed tensors are built directly from random
4-bit codes and scales, which transformers then loads (Mxfp4Config(dequantize=True), on CPU) as
the judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatronish import load_model, ops
from megatronish.accounting.parameters import parameter_count
from megatronish.config import derive, load_config
from megatronish.hf.gpt_oss import dequantize_mxfp4
from tests.conftest import CONFIGS, invoke_cli
from tests.hf.test_hf_families import random_model
from tests.hf.test_hf_qwen3_5 import relative
from tests.tolerances import BF16_EXPERTS_REL, PARITY_REL

transformers = pytest.importorskip("transformers")

VOCAB = 101
YARN = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=16,
)
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=40,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters=YARN,
)
# MXFP4 packs 32 values a group along each row: d_model and the experts' d_ff multiples of 32.
MXFP4_SHAPE = dict(
    SHAPE, hidden_size=64, intermediate_size=32, num_hidden_layers=2, layer_types=None
)
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # MXFP4 in the published ones
MXFP4_CONFIG = {  # as the published checkpoints' config.json
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))


def _cli(*args: str):
    result = invoke_cli(*args)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    model = random_model("GptOssForCausalLM", SHAPE)
    hf, ours, back = root / "hf", root / "ours", root / "back"
    model.save_pretrained(hf)
    _cli("import", "--hf", str(hf), "--output", str(ours))
    exported = _cli("export", "--checkpoint", str(ours), "--output", str(back))
    return model, hf, ours, back, exported.stdout


def test_import_export_and_load_back_of_a_gpt_oss_model_agree_with_transformers(built):
    from safetensors.torch import load_file

    model, hf, ours, back, _ = built
    config = load_model(ours).config.model
    assert (config.arch, config.sliding_window, config.swiglu_limit) == ("gpt_oss", 4, 7.0)
    assert config.layer_types == SHAPE["layer_types"]
    assert (config.moe.router, config.moe.aux_loss_coef, config.moe.num_experts) == (
        "topk_softmax",
        0.0,
        4,
    )
    with torch.no_grad():
        want, got = model(_tokens()).logits, load_model(ours)(_tokens())
    assert relative(got, want) < PARITY_REL
    theirs, again = (
        load_file(str(hf / "model.safetensors")),
        load_file(str(back / "model.safetensors")),
    )
    assert sorted(again) == sorted(theirs)
    for key, tensor in theirs.items():
        if key.endswith(EXPERTS):
            tensor = tensor.to(torch.bfloat16)
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    assert type(loaded).__name__ == "GptOssForCausalLM"
    assert loaded.config.layer_types == SHAPE["layer_types"]
    with torch.no_grad():
        exported = loaded.eval()(_tokens()).logits
    assert 0 < relative(exported, got) < BF16_EXPERTS_REL  # rounded, within its bound


def test_the_bf16_experts_of_an_export_import_exactly_and_give_transformers_logits(built, tmp_path):
    from safetensors.torch import load_file

    model, _, _, back, _ = built
    again = tmp_path / "again"
    _cli("import", "--hf", str(back), "--output", str(again))
    reloaded = load_model(again)
    exported = load_file(str(back / "model.safetensors"))
    experts = reloaded.gpt.blocks["0"].mlp.experts
    up = exported["model.layers.0.mlp.experts.gate_up_proj"].float().transpose(1, 2)
    assert torch.equal(experts.up.detach(), up[:, 1::2])
    down = exported["model.layers.0.mlp.experts.down_proj"].float().transpose(1, 2)
    assert torch.equal(experts.down.detach(), down)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    with torch.no_grad():
        want, got = loaded.eval()(_tokens()).logits, reloaded(_tokens())
    assert relative(got, want) < PARITY_REL


def test_export_of_gpt_oss_says_in_one_line_that_the_experts_are_bf16(built):
    notes = [line for line in built[4].splitlines() if "MXFP4" in line]
    line = "note: experts written in bf16 (the published checkpoint stores them in MXFP4)"
    assert notes == [line]


@pytest.mark.parametrize("limit", [7.0, 0.5])  # the published limit, and one that binds often
def test_the_clamped_swiglu_is_transformers_gpt_oss_gate_bit_for_bit(limit):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(
        hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=limit
    )
    experts = GptOssExperts(config)
    gate_up = (torch.randn(5, 12, generator=torch.Generator().manual_seed(0)) * 4).requires_grad_()
    want = experts._apply_gate(gate_up)
    gate, up = gate_up[:, ::2], gate_up[:, 1::2]  # transformers interleaves them
    got = ops.activate("clamped_swiglu", gate, up, limit)
    assert torch.equal(got, want)
    grad = torch.randn_like(want)
    (theirs,) = torch.autograd.grad(want, gate_up, grad)
    (ours,) = torch.autograd.grad(got, gate_up, grad)
    assert torch.equal(ours, theirs)


def test_gpt_oss_20b_has_the_parameters_transformers_counts_of_its_shapes():
    config = transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.GptOssForCausalLM(config).parameters())
    cfg = load_config(CONFIGS / "gpt-oss-20b.yaml")
    assert parameter_count(cfg, derive(cfg, 8)) == theirs == 20_914_757_184


def _packed(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [*shape, 16] (every 4-bit code) and scales `shape` (2^-7 .. 2^6)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    return blocks, torch.randint(120, 134, shape, dtype=torch.uint8, generator=gen)


def _mxfp4_checkpoint(hf: Path, scales_rows: int | None = None) -> None:
    """A tiny GptOssForCausalLM saved with its experts as MXFP4 blocks and scales (the scales of
    the first gate_up_proj cut to scales_rows rows where given)."""
    from safetensors.torch import load_file, save_file

    random_model("GptOssForCausalLM", MXFP4_SHAPE).save_pretrained(hf)
    tensors = load_file(str(hf / "model.safetensors"))
    h, f, experts = MXFP4_SHAPE["hidden_size"], MXFP4_SHAPE["intermediate_size"], 4
    for i in range(MXFP4_SHAPE["num_hidden_layers"]):
        for seed, (name, rows, groups) in enumerate(
            (("gate_up_proj", 2 * f, h), ("down_proj", h, f))
        ):
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            blocks, scales = _packed((experts, rows, groups // 32), 10 * i + seed)
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    if scales_rows is not None:
        key = "model.layers.0.mlp.experts.gate_up_proj_scales"
        tensors[key] = tensors[key][:, :scales_rows].contiguous()
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, quantization_config=MXFP4_CONFIG)))


def test_mxfp4_dequantization_equals_transformers_convert_moe_packed_tensors_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed((3, 10, 2), 0)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales, "x"), want)


def test_an_mxfp4_checkpoint_imports_with_the_experts_transformers_dequantizes(tmp_path):
    hf, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
    _mxfp4_checkpoint(hf)
    _cli("import", "--hf", str(hf), "--output", str(ours))
    _cli("export", "--checkpoint", str(ours), "--output", str(back))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        hf, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    ours_back = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    ours_params = dict(ours_back.named_parameters())
    for name, param in theirs.named_parameters():
        assert torch.equal(ours_params[name], param), name
    with torch.no_grad():
        want = theirs.eval()(_tokens()).logits
        assert relative(load_model(ours)(_tokens()), want) < PARITY_REL


def test_an_mxfp4_tensor_whose_scales_disagree_with_its_blocks_is_exit_2_naming_both(tmp_path):
    hf = tmp_path / "hf"
    _mxfp4_checkpoint(hf, scales_rows=5)
    result = invoke_cli("import", "--hf", str(hf), "--output", str(tmp_path / "ours"))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert f"{name}_blocks of shape [4, 64, 2, 16]" in result.stderr
    assert f"{name}_scales of shape [4, 5, 2]" in result.stderr
    assert not (tmp_path / "ours").exists()
