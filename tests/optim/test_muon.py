"""Muon (optim.name muon): its settings are checked one line each, its arithmetic is
torch.optim.Muon's bit for bit on a matrix, it takes the blocks' logical matrices (fused q, k
and v apart, each expert apart) and leaves the rest to AdamW, and a run from Hugging Face
weights follows transformers trained by torch.optim.Muon on q, k, v, o, gate, up and down plus
torch.optim.AdamW on the rest (tests/hf/curve.py), within the reference's own noise floor x 10
(tests/tolerances.py: MUON_CURVE_REL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatronish.config import load_config
from megatronish.data import dataset_vocab_size
from megatronish.distributed.layout import ParallelState
from megatronish.optim.muon import MuonOptimizer
from megatronish.optim.muon_matrices import muon_matrices
from megatronish.optim.registry import optimizer_named
from tests.conftest import CONFIGS
from tests.hf.curve import CURVE_STEPS, LLAMA_SHAPE, decays, reference_curve, run_settings
from tests.parity import (
    LLAMA,
    assert_check_fails_with_one_line,
    assert_close,
    make_config,
    make_trainer,
    train_counted,
)
from tests.tolerances import MUON_CURVE_REL, MUON_NORM_REL

MUON = ["optim.name=muon", "train.weight_decay=0.1"]


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["optim.muon.momentum=0.9"], "optim.muon"),
        (["optim.name=muon", "optim.muon.lr_adjust=rms"], "optim.muon.lr_adjust"),
        (["optim.name=muon", "optim.muon.ns_steps=0"], "optim.muon.ns_steps"),
        (["optim.name=muon", "optim.muon.ns_steps=100"], "optim.muon.ns_steps"),
        (["optim.name=muon", "optim.muon.momentum=-0.1"], "optim.muon.momentum"),
        (["optim.name=muon", "optim.muon.qk_clip_tau=0"], "optim.muon.qk_clip_tau"),
        (["optim.name=muon", "optim.muon.ns_coefficients=[1,2]"], "optim.muon.ns_coefficients"),
        (["optim.name=muon", "optim.muon.ns_coefficients=[1,2,x]"], "optim.muon.ns_coefficients"),
    ],
)
def test_a_bad_muon_setting_is_one_line_naming_its_key(sets, key):
    args = ["--config", str(CONFIGS / "tiny.yaml")]
    for s in sets:
        args += ["--set", s]
    assert_check_fails_with_one_line(args, key)


@pytest.mark.parametrize("shape", [(24, 10), (10, 24)])  # tall (transposed) and wide
def test_a_muon_step_is_torch_optim_muons_bit_for_bit(shape):
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(shape[1], shape[0], bias=False), None
    theirs = torch.nn.Linear(shape[1], shape[0], bias=False)
    theirs.load_state_dict(ours.state_dict())
    cfg = load_config(None, [*MUON, "train.lr=0.02"])
    update = MuonOptimizer().build(
        [
            {
                "params": [ours.weight],
                "weight_decay": 0.1,
                "muon": True,
                "matrices": muon_matrices_of(ours),
                "tp_group": None,
            }
        ],
        cfg,
    )
    reference = torch.optim.Muon(
        [theirs.weight], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    for _ in range(3):
        grad = torch.randn(shape)
        ours.weight.grad, theirs.weight.grad = grad.clone(), grad.clone()
        update.step()
        reference.step()
        assert torch.equal(ours.weight, theirs.weight)
    buffer = update.state[ours.weight]["momentum_buffer"]
    assert torch.equal(buffer, reference.state[theirs.weight]["momentum_buffer"])


def muon_matrices_of(linear: torch.nn.Linear):
    """A bare linear's one matrix, as muon_matrices finds an MTP module's eh_proj."""
    holder = torch.nn.Module()
    holder.mtp = torch.nn.ModuleList([linear])
    return muon_matrices(holder)


def test_muon_takes_the_blocks_logical_matrices_and_adamw_the_rest(dataset):
    cfg = make_config(1, 1, 1, LLAMA + MUON + ["model.n_layer=1"], dataset)
    model = make_trainer(cfg, 1, dataset, ParallelState.single()).model
    optim = optimizer_named("muon")
    muon, *rest = optim.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in muon["params"]) == [
        "blocks.0.attn.proj.weight",
        "blocks.0.attn.qkv.weight",
        "blocks.0.mlp.down.weight",
        "blocks.0.mlp.gate.weight",
        "blocks.0.mlp.up.weight",
    ]
    qkv = [m for m in muon["matrices"] if names[id(m.param)] == "blocks.0.attn.qkv.weight"]
    # q, k and v apart: 4 heads of 8 (2 per kv group), one key and one value head per group
    assert [tuple(m.local(m.param).shape) for m in qkv] == [(32, 32), (16, 32), (16, 32)]
    others = {names[id(p)] for g in rest for p in g["params"]}
    assert "tok_emb.weight" in others and "lm_head.weight" in others
    assert not others & {names[id(p)] for p in muon["params"]}


# transformers class -> its tiny model (fp32, eager attention): Llama with GQA, Qwen3 with q/k
# norms and heads of 12 (apart from hidden / heads).
FAMILIES = {
    "LlamaForCausalLM": dict(LLAMA_SHAPE, rope_theta=5000.0),
    "Qwen3ForCausalLM": dict(LLAMA_SHAPE, head_dim=12),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_muon_run_from_imported_weights_follows_torch_optim_muon(family, dataset, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    model_class = getattr(transformers, family)
    config = model_class.config_class(
        vocab_size=dataset_vocab_size(dataset), attn_implementation="eager", **FAMILIES[family]
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model_class(config).save_pretrained(tmp_path / "hf")
    cfg = make_config(1, 1, 1, run_settings(tmp_path / "hf") + MUON, dataset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        losses, norms, _ = train_counted(trainer, CURVE_STEPS)
        decay = decays(trainer, tmp_path / "hf", tmp_path / "decays")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", attn_implementation="eager"
        )
        ref_losses, ref_norms = reference_curve(theirs, decay, cfg, dataset)
    finally:
        torch.set_num_threads(threads)
    assert ref_losses[-1] < ref_losses[0] - 1.0  # it learns
    assert_close(losses, ref_losses, rel=MUON_CURVE_REL, steps=CURVE_STEPS)
    assert_close(norms, ref_norms, rel=MUON_NORM_REL, steps=CURVE_STEPS)
