"""Hugging Face export and import of our models: transformers loads an exported checkpoint (as
GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM for an MoE llama, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and Qwen3MoeForCausalLM) with no custom code and computes
the same logits; importing it back gives the same model; training can start from an HF
directory's weights; a model a family cannot express is one line. (Models built by
transformers, imported and exported back: test_hf_families.py.)"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from click.testing import CliRunner

from megatronish import load_model
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import tokenizer_of_dataset
from megatronish.cli import cli
from megatronish.config import Config, derive, load_config
from megatronish.data import dataset_vocab_size, load_tokenizer
from megatronish.errors import UserError
from megatronish.hf.exporter import export_hf
from megatronish.hf.importer import import_hf, model_settings
from megatronish.hf.registry import family_of_model
from megatronish.training.setup import setup
from megatronish.training.trainer import Trainer
from tests.checkpoints import (
    VOCAB,
    prepare_small_dataset,
    save_single,
    tiny_cfg,
    tokens,
)
from tests.conftest import CONFIGS as SHIPPED
from tests.conftest import REPO, finish, run_cli, start
from tests.tolerances import PARITY_LOGIT_SUM_ABS, PARITY_LOGITS_ABS, PARITY_REL

transformers = pytest.importorskip("transformers")

MOE = ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_ff=48")
GQA = ("model.n_kv_head=2", "model.d_ff=96")  # as tiny_cfg gives llama
# HF model type -> (our arch, overrides of tiny_cfg's model; or a shipped tiny config, which the
# tests train with SHORT's fewer layers and shorter batches)
CONFIGS = {
    "gpt2": ("gpt2", ()),  # tied embeddings, biases, learned positions
    "llama": ("llama", ("model.rope_theta=5000", "model.norm_eps=1e-6")),  # GQA 4/2, untied
    "mixtral": ("llama", MOE),  # every MLP 4 experts, top 2
    "mistral": ("mistral", GQA),
    "qwen2": ("qwen2", GQA),  # q, k and v biases
    "qwen3": ("tiny-qwen3.yaml", ()),  # q and k norms, head_dim apart, tied
    "qwen3_moe": ("tiny-qwen3-moe.yaml", ("model.moe.every=2",)),  # block 1 dense
}
SHORT = (
    "model.n_layer=2",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
)
CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"hf-{arch}")
    step_dir, _ = save_single(root / "ckpt", _cfg(arch))
    result = CliRunner().invoke(
        cli,
        [
            "export",
            "--checkpoint",
            str(root / "ckpt"),
            "--format",
            "hf",
            "--output",
            str(root / "hf"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "no tokenizer written" in result.output  # the tiny model is byte-level
    return arch, step_dir, root / "hf"


def _cfg(kind: str, *extra: str) -> Config:
    arch, overrides = CONFIGS[kind]
    if arch.endswith(".yaml"):
        return load_config(
            SHIPPED / arch, [f"model.vocab_size={VOCAB}", *SHORT, *overrides, *extra]
        )
    return tiny_cfg(arch, *overrides, *extra)


def test_transformers_loads_the_export_and_computes_the_same_logits(exported):
    arch, step_dir, hf_dir = exported
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["model_type"] == arch
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf_model).__name__ == CLASSES[arch]
    assert hf_model.dtype == torch.float32
    cfg = _cfg(arch)
    derived = derive(cfg, 1)
    assert hf_model.config.tie_word_embeddings == derived.tie_embeddings
    if arch != "gpt2":
        assert hf_model.config.num_key_value_heads == 2
        assert hf_model.config.head_dim == derived.head_dim
    moe = cfg.model.moe
    if moe.num_experts:
        assert hf_model.config.num_local_experts == moe.num_experts
        assert hf_model.config.num_experts_per_tok == moe.top_k
        key = "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"
        assert config[key] == moe.d_ff
    if arch == "qwen3_moe":  # experts every 2 blocks
        assert config["mlp_only_layers"] == [1]
        assert type(hf_model.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"
    with torch.no_grad():
        theirs = hf_model(tokens(2, 30)).logits
        ours = load_model(step_dir)(tokens(2, 30))
    assert theirs.shape == ours.shape == (2, 30, VOCAB)
    assert (theirs - ours).abs().max() < PARITY_LOGITS_ABS


@pytest.mark.slow  # two subprocesses, one importing transformers
@pytest.mark.parametrize("exported", ["llama"], indirect=True)  # any one family will do
def test_from_the_repo_root_export_runs_and_transformers_loads_it_without_shadowing(
    exported, tmp_path
):
    """The repo's kernels/ folder (installed as megatronish_kernels) must not shadow PyPI's
    `kernels`, which transformers imports: the documented export command and a transformers load
    of its output both run with the repo root as the working directory and first on the path,
    as a user's `python -c` there has it."""
    arch, step_dir, _ = exported
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = tmp_path / "hf"
    args = ["--checkpoint", str(step_dir.parent), "--format", "hf", "--output", str(out)]
    export = run_cli("export", *args, cwd=REPO)
    assert export.returncode == 0, export.stderr
    code = (
        "import sys, torch, transformers, kernels\n"
        "assert 'megatronish' not in (kernels.__file__ or ''), kernels.__file__\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "tokens = torch.arange(30).remainder(model.config.vocab_size)[None]\n"
        "print(model(tokens).logits.double().sum().item())"
    )
    loaded = finish(start([sys.executable, "-c", code, str(out)], env=env, cwd=REPO))
    assert loaded.returncode == 0, loaded.stderr
    with torch.no_grad():
        ours = load_model(step_dir)(torch.arange(30).remainder(VOCAB)[None]).double().sum()
    assert float(loaded.stdout) == pytest.approx(
        ours.item(), rel=PARITY_REL, abs=PARITY_LOGIT_SUM_ABS
    )


def test_import_of_the_export_gives_back_the_same_model(exported, tmp_path):
    arch, step_dir, hf_dir = exported
    result = CliRunner().invoke(
        cli, ["import", "--hf", str(hf_dir), "--output", str(tmp_path / "back")]
    )
    assert result.exit_code == 0, result.output
    back, original = load_model(tmp_path / "back"), load_model(step_dir)
    assert back.step == 0 and back.config.model.arch == _cfg(arch).model.arch
    settings = model_settings(back.config, derive(back.config, 1))
    assert settings == model_settings(original.config, derive(original.config, 1))
    for (name, a), b in zip(original.gpt.named_parameters(), back.gpt.parameters()):
        assert torch.equal(a, b), name


def _copy_of(hf_dir, to, **config_changes):
    """A copy of an HF directory with config.json's keys changed (None: removed)."""
    shutil.copytree(hf_dir, to)
    config = json.loads((to / "config.json").read_text())
    config.update(config_changes)
    config = {key: value for key, value in config.items() if value is not None}
    (to / "config.json").write_text(json.dumps(config))
    return to


def _assert_same_weights(a, b) -> None:
    for (name, x), y in zip(a.gpt.named_parameters(), b.gpt.parameters(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("exported", ["mixtral"], indirect=True)
def test_import_finds_the_family_by_architectures_then_by_model_type(exported, tmp_path):
    _, step_dir, hf_dir = exported
    by_name = _copy_of(hf_dir, tmp_path / "by-name", model_type="some-fork")
    by_type = _copy_of(hf_dir, tmp_path / "by-type", architectures=None)
    for source in (by_name, by_type):
        import_hf(str(source), str(tmp_path / f"{source.name}-ckpt"))
        back = load_model(tmp_path / f"{source.name}-ckpt")
        assert back.config.model.moe.num_experts == 4
        _assert_same_weights(load_model(step_dir), back)
    unknown = _copy_of(hf_dir, tmp_path / "unknown", architectures=["X"], model_type="y")
    with pytest.raises(UserError, match=r"model_type 'y', architectures \['X'\]; .* mixtral"):
        import_hf(str(unknown), str(tmp_path / "out"))


@pytest.mark.parametrize("exported", ["llama"], indirect=True)
def test_import_reads_weights_sharded_over_files_by_an_index(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    _, step_dir, hf_dir = exported
    sharded = _copy_of(hf_dir, tmp_path / "sharded")
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for index, part in enumerate((names[::2], names[1::2])):
        file = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(sharded / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    import_hf(str(sharded), str(tmp_path / "back"))
    _assert_same_weights(load_model(step_dir), load_model(tmp_path / "back"))


@pytest.mark.parametrize("exported", ["gpt2", "mixtral", "qwen3"], indirect=True)
def test_training_can_start_from_an_hf_directory(exported, tmp_path, small_dataset):
    arch, step_dir, hf_dir = exported
    data = small_dataset
    cfg = _cfg(arch, f"data.path={data}", f"checkpoint.init_from_hf={hf_dir}")
    cfg.run.out_dir = str(tmp_path / "run")
    trainer = Trainer(setup(cfg))
    assert trainer.resumed_from is None and trainer.step == 0
    for (name, want), got in zip(
        load_model(step_dir).gpt.named_parameters(), trainer.model.parameters()
    ):
        assert torch.equal(got, want), name
    wrong = _cfg(
        arch,
        "model.n_head=2",
        "model.n_kv_head=2",
        f"data.path={data}",
        f"checkpoint.init_from_hf={hf_dir}",
    )
    with pytest.raises(
        UserError, match=r"config.json: this config differs .* n_head 2 \(model has 4\)"
    ):
        Trainer(setup(wrong))


def test_import_refuses_what_it_cannot_run(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="model_type 'bert'"):
        import_hf(str(hf_dir), str(tmp_path / "out"))
    with pytest.raises(UserError, match="checkpoint does not exist"):
        export_hf(str(tmp_path / "none"), str(tmp_path / "out"))


def test_a_window_exports_only_as_a_family_whose_class_has_that_window():
    from megatronish.config import derive
    from megatronish.hf.registry import family_of_model

    cfg = tiny_cfg("llama", "model.sliding_window=8")
    with pytest.raises(UserError) as error:
        family_of_model(cfg, derive(cfg, 1))
    assert str(error.value) == (
        "model.sliding_window=8: LlamaForCausalLM (model.arch llama, export --format hf) cannot "
        "express it; model.arch gemma3, gpt_oss, mistral, qwen2, qwen3, qwen3_moe can"
    )
    cfg = tiny_cfg("mistral", "model.sliding_window=8", "model.full_attention_layers=1")
    with pytest.raises(UserError, match="model.full_attention_layers=1: MistralForCausalLM .*"):
        family_of_model(cfg, derive(cfg, 1))
    qwen = tiny_cfg("qwen2", "model.sliding_window=8", "model.full_attention_layers=1")
    assert family_of_model(qwen, derive(qwen, 1)).architecture == "Qwen2ForCausalLM"


def test_a_bpe_tokenizer_travels_with_the_export_and_back(tmp_path):
    data = prepare_small_dataset(tmp_path / "data", tokenizer="bpe", vocab_size=300)
    vocab = dataset_vocab_size(data)
    cfg = tiny_cfg("gpt2", f"model.vocab_size={vocab}")
    save_single(tmp_path / "ckpt", cfg, tokenizer=tokenizer_of_dataset(data))
    lines = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert "tokenizer: tokenizer.json (end of text '<|endoftext|>')" in lines
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_tokenizer(data)
    text = 'def f(x):\n    return {"a": x}\n'
    assert theirs.encode(text) == ours.encode(text) and theirs.eos_token == "<|endoftext|>"
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size
        == vocab
    )
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    back = Checkpoint(tmp_path / "back").tokenizer()
    assert back.encode(text) == ours.encode(text) and back.eot_id == ours.eot_id


def test_export_of_a_model_its_family_cannot_express_exits_2_with_one_line(tmp_path):
    save_single(tmp_path / "ckpt", tiny_cfg("llama", *MOE, "model.moe.every=2"), step=0)
    result = CliRunner().invoke(
        cli,
        ["export", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")],
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert "model.moe.every" in lines[0] and "Mixtral" in lines[0], lines[0]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("llama", *MOE, "model.moe.shared_expert=true"), ("model.moe.shared_expert", "Mixtral")),
        (("qwen3_moe", *GQA, *MOE, "model.moe.shared_expert=true"), ("Qwen3MoeForCausalLM",)),
        (("qwen3_moe", *GQA, *MOE, "model.moe.n_shared_experts=1"), ("n_shared_experts",)),
        (("qwen3_moe", *GQA, *MOE, "model.moe.router=sigmoid"), ("model.moe.router", "softmax")),
        (
            ("qwen3_moe", *GQA, *MOE, "model.sliding_window=4", "model.full_attention_layers=1"),
            ("model.full_attention_layers=1", "qwen2, qwen3 can"),
        ),
        (
            ("llama", "model.qk_norm=true"),
            ("model.qk_norm=true", "arch llama", "qwen3, qwen3_5, qwen3_moe"),
        ),
        (("qwen2", *GQA, "model.qkv_bias=false"), ("model.qkv_bias=false", "Qwen2ForCausalLM")),
        (("qwen3", *GQA, *MOE), ("model.moe.num_experts=4", "llama, qwen3_5, qwen3_moe")),
    ],
)
def test_export_names_the_setting_a_family_cannot_express_and_the_archs_that_can(args, needles):
    cfg = tiny_cfg(*args)
    derived = derive(cfg, 1)
    with pytest.raises(UserError) as error:  # what export_hf runs before reading a tensor
        family_of_model(cfg, derived).config_json(cfg, derived)
    assert all(needle in str(error.value) for needle in needles), str(error.value)
