"""A LoRA run resumes bit for bit, and its adapter leaves as peft reads it and comes back:
`export --format peft` gives a directory peft.PeftModel.from_pretrained loads over the base
model with our logits, `export --format hf --merge-lora` a merged model transformers loads with
our logits, and
checkpoint.init_lora_from starts a run from that adapter (its adapters equal the checkpoint's).
Exporting a LoRA checkpoint as a plain hf model (which would drop the adapters) exits 2."""

from __future__ import annotations

import pytest
import torch

from megatronish import load_model
from megatronish.distributed.layout import ParallelState
from megatronish.moe.experts import stored_tensors
from tests.conftest import invoke_cli
from tests.hf.curve import run_settings
from tests.hf.test_lora_curve import LORA_SETTINGS, tiny_llama
from tests.parity import make_config, make_trainer, train_counted
from tests.tolerances import PARITY_LOGITS_ABS

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS = 3  # saved at steps 2 and 3


@pytest.fixture(scope="module")
def run(dataset, tmp_path_factory) -> dict:
    """A 3-step LoRA run from a tiny Llama, its checkpoint and its peft and merged exports."""
    root = tmp_path_factory.mktemp("lora-export")
    hf_dir = tiny_llama(dataset, root / "llama")
    sets = run_settings(hf_dir) + LORA_SETTINGS
    sets += [f"train.steps={STEPS}", f"checkpoint.dir={root / 'ckpt'}", "train.lr=0.05"]
    trainer = make_trainer(make_config(1, 1, 1, sets, dataset), 1, dataset, ParallelState.single())
    losses, norms, _ = train_counted(trainer, STEPS, save_every=1)
    for args in (["--format", "peft"], ["--format", "hf", "--merge-lora"]):
        out = root / args[1]
        result = invoke_cli(
            "export", "--checkpoint", str(root / "ckpt"), "--output", str(out), *args
        )
        assert result.returncode == 0, result.stderr
    return dict(root=root, hf=hf_dir, ckpt=root / "ckpt", sets=sets, dataset=dataset, losses=losses)


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))


def test_the_peft_export_loads_in_peft_with_our_logits_and_so_does_the_merged_hf_export(run):
    ours = load_model(run["ckpt"])
    batch = tokens(ours.vocab_size)
    with torch.no_grad():
        expected = ours(batch)
        base = transformers.AutoModelForCausalLM.from_pretrained(run["hf"]).eval()
        # the adapters moved the logits: the comparison sees them (peft adapts base in place)
        assert (base(batch).logits - expected).abs().max() > 100 * PARITY_LOGITS_ABS
        adapted = peft.PeftModel.from_pretrained(base, run["root"] / "peft").eval()
        merged = transformers.AutoModelForCausalLM.from_pretrained(run["root"] / "hf").eval()
        for model in (adapted, merged):
            assert (model(batch).logits - expected).abs().max() <= PARITY_LOGITS_ABS


def test_a_run_from_the_peft_export_starts_with_the_checkpoints_adapters(run):
    sets = run["sets"][:-3] + [f"checkpoint.init_lora_from={run['root'] / 'peft'}"]
    sets += [f"checkpoint.dir={run['root'] / 'again'}"]
    cfg = make_config(1, 1, 1, sets, run["dataset"])
    trainer = make_trainer(cfg, 1, run["dataset"], ParallelState.single())
    saved = load_model(run["ckpt"]).gpt.state_dict()
    for name, param, _ in stored_tensors(trainer.model.named_parameters()):
        if param.requires_grad:
            assert torch.equal(param.detach(), saved[name]), name


def test_a_plain_hf_export_of_a_lora_checkpoint_exits_2_in_one_line(run, tmp_path):
    out = tmp_path / "plain"
    result = invoke_cli("export", "--checkpoint", str(run["ckpt"]), "--output", str(out))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "--merge-lora" in line and "--format peft" in line and not out.exists()


def test_a_lora_run_resumes_bit_for_bit(run):
    """From step 2's checkpoint (adapters, their AdamW moments and the frozen base), step 3
    gives the same loss and the same weights as the run that went straight on."""
    sets = run["sets"] + [
        f"checkpoint.resume={run['ckpt'] / 'step_000002'}",
        "checkpoint.save=false",
    ]
    cfg = make_config(1, 1, 1, sets, run["dataset"])
    trainer = make_trainer(cfg, 1, run["dataset"], ParallelState.single())
    assert trainer.step == 2
    losses, _, _ = train_counted(trainer, STEPS)
    assert losses == run["losses"][2:]
    saved = load_model(run["ckpt"]).gpt.state_dict()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name


def test_an_adapter_of_another_rank_is_a_user_error_naming_both(run):
    from megatronish.errors import UserError

    adapter = run["root"] / "peft"
    sets = run["sets"][:-3] + [f"checkpoint.init_lora_from={adapter}", "model.lora.rank=8"]
    sets += [f"checkpoint.dir={run['root'] / 'other-rank'}"]
    cfg = make_config(1, 1, 1, sets, run["dataset"])
    with pytest.raises(UserError, match="checkpoint.init_lora_from: .* has r 4, model.lora 8"):
        make_trainer(cfg, 1, run["dataset"], ParallelState.single())
