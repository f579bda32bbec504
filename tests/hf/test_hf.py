"""Hugging Face export and import: transformers loads an exported checkpoint (gpt2, llama, and
an MoE llama as Mixtral) with no custom code and computes the same logits; importing it back
gives the same model; training can start from an HF directory's weights; an MoE that Mixtral
cannot express is one line."""

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
from megatronish.data import dataset_vocab_size, load_tokenizer
from megatronish.errors import UserError
from megatronish.hf.exporter import export_hf
from megatronish.hf.importer import import_hf
from megatronish.training.setup import setup
from megatronish.training.trainer import Trainer
from tests.checkpoints import (
    VOCAB,
    prepare_small_dataset,
    save_single,
    tiny_cfg,
    tokens,
)
from tests.conftest import REPO, finish, run_cli, start

transformers = pytest.importorskip("transformers")

MOE = ("model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_ff=48")
# HF model type -> (our arch, overrides)
CONFIGS = {
    "gpt2": ("gpt2", ()),  # tied embeddings, biases, learned positions
    "llama": ("llama", ("model.rope_theta=5000", "model.norm_eps=1e-6")),  # GQA 4/2, untied
    "mixtral": ("llama", MOE),  # every MLP 4 experts, top 2
}
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"hf-{arch}")
    step_dir, _ = save_single(root / "ckpt", tiny_cfg(*_cfg_args(arch)))
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


def _cfg_args(kind: str) -> tuple[str, ...]:
    arch, extra = CONFIGS[kind]
    return (arch, *extra)


def test_transformers_loads_the_export_and_computes_the_same_logits(exported):
    arch, step_dir, hf_dir = exported
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["model_type"] == arch
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(hf_model).__name__ == CLASSES[arch]
    assert hf_model.dtype == torch.float32
    if arch != "gpt2":
        assert hf_model.config.num_key_value_heads == 2 and not hf_model.config.tie_word_embeddings
    if arch == "mixtral":
        assert hf_model.config.num_local_experts == 4 and hf_model.config.num_experts_per_tok == 2
        names = json.loads((hf_dir / "config.json").read_text())
        assert names["intermediate_size"] == 48
    with torch.no_grad():
        theirs = hf_model(tokens(2, 30)).logits
        ours = load_model(step_dir)(tokens(2, 30))
    assert theirs.shape == ours.shape == (2, 30, VOCAB)
    assert (theirs - ours).abs().max() < 1e-4


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
    assert float(loaded.stdout) == pytest.approx(ours.item(), rel=1e-4, abs=1e-3)


def test_import_of_the_export_gives_back_the_same_model(exported, tmp_path):
    arch, step_dir, hf_dir = exported
    result = CliRunner().invoke(
        cli, ["import", "--hf", str(hf_dir), "--output", str(tmp_path / "back")]
    )
    assert result.exit_code == 0, result.output
    back, original = load_model(tmp_path / "back"), load_model(step_dir)
    assert back.step == 0 and back.config.model.arch == CONFIGS[arch][0]
    assert back.config.model.moe == original.config.model.moe
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


def test_training_can_start_from_an_hf_directory(exported, tmp_path, small_dataset):
    arch, step_dir, hf_dir = exported
    data = small_dataset
    cfg = tiny_cfg(*_cfg_args(arch), f"data.path={data}", f"checkpoint.init_from_hf={hf_dir}")
    cfg.run.out_dir = str(tmp_path / "run")
    trainer = Trainer(setup(cfg))
    assert trainer.resumed_from is None and trainer.step == 0
    for (name, want), got in zip(
        load_model(step_dir).gpt.named_parameters(), trainer.model.parameters()
    ):
        assert torch.equal(got, want), name
    wrong = tiny_cfg(
        *_cfg_args(arch),
        "model.n_head=2",
        "model.n_kv_head=2",
        f"data.path={data}",
        f"checkpoint.init_from_hf={hf_dir}",
    )
    with pytest.raises(UserError, match=r"config.json: the model has n_head 4, this config 2"):
        Trainer(setup(wrong))


def test_import_refuses_what_it_cannot_run(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="model_type 'bert'"):
        import_hf(str(hf_dir), str(tmp_path / "out"))
    with pytest.raises(UserError, match="checkpoint does not exist"):
        export_hf(str(tmp_path / "none"), str(tmp_path / "out"))


def test_a_llama_with_a_sliding_window_does_not_export_as_a_llama_without_it():
    from megatronish.config import derive
    from megatronish.hf.registry import family_of_model

    cfg = tiny_cfg("llama", "model.sliding_window=8")
    with pytest.raises(UserError) as error:
        family_of_model(cfg, derive(cfg, 1))
    assert str(error.value) == (
        "model.sliding_window: no Hugging Face family here exports it (only models with "
        "model.sliding_window=null export)"
    )


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


@pytest.mark.parametrize(
    ("extra", "key"),
    [(("model.moe.every=2",), "model.moe.every"), (("model.moe.shared_expert=true",), "shared")],
)
def test_an_moe_mixtral_cannot_express_exits_2_with_one_line(extra, key, tmp_path):
    save_single(tmp_path / "ckpt", tiny_cfg("llama", *MOE, *extra), step=0)
    result = CliRunner().invoke(
        cli,
        [
            "export",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--format",
            "hf",
            "--output",
            str(tmp_path / "hf"),
        ],
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "hf").exists()


def test_a_llama_whose_head_dim_is_not_hidden_per_head_imports_and_exports_with_its_logits(
    tmp_path,
):
    """Heads of 12 on hidden 32 (as Qwen3's 128 on 1024 over 16 heads): transformers' model ->
    our import -> the same logits; our export of it -> transformers, the same logits again."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(3)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    import_hf(str(tmp_path / "theirs"), str(tmp_path / "ours"))
    ours = load_model(tmp_path / "ours")
    assert ours.config.model.head_dim == 12
    assert ours.gpt.blocks["0"].attn.qkv.weight.shape == ((4 + 2 * 2) * 12, 32)
    x = tokens(2, 30)
    with torch.no_grad():
        want = theirs(x).logits
        assert (ours(x) - want).abs().max() < 1e-4
    args = ["export", "--checkpoint", str(tmp_path / "ours"), "--format", "hf"]
    result = CliRunner().invoke(cli, [*args, "--output", str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "back" / "config.json").read_text())["head_dim"] == 12
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert (back(x).logits - want).abs().max() < 1e-4
