"""The optimizer interface (optim.interface): AdamW is found by name, declares the state a
checkpoint stores, and says which parameters it needs whole (which ZeRO leaves out of its
buckets): AdamW none, Muon its matrices only."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from megatronish.checkpoint.format import OPTIM_KINDS
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model.gpt import GPT
from megatronish.optim.adamw import AdamW, AdamWOptimizer
from megatronish.optim.muon_matrices import muon_matrices
from megatronish.optim.registry import optimizer_named


def test_adamw_is_registered_by_name_and_declares_the_state_a_checkpoint_stores():
    adamw = optimizer_named("adamw")
    assert isinstance(adamw, AdamWOptimizer)
    assert adamw.state.kinds == ("exp_avg", "exp_avg_sq", "step")
    assert set(adamw.state.kinds) <= set(OPTIM_KINDS)  # what an optim file may hold
    assert adamw.needs_whole(nn.Linear(2, 3)) == []
    cfg = SimpleNamespace(
        train=SimpleNamespace(lr=0.1), optim=SimpleNamespace(beta1=0.9, beta2=0.95, eps=1e-8)
    )
    update = adamw.build(adamw.param_groups(nn.Linear(2, 3), 0.1), cfg)
    assert isinstance(update, AdamW)
    assert [g["weight_decay"] for g in update.param_groups] == [0.1, 0.0]


def test_muon_needs_its_matrices_whole_and_not_the_embeddings_or_norms():
    cfg = load_config(None, ["model.n_layer=1", "model.vocab_size=32"])
    model = GPT(cfg, derive(cfg, 1), ParallelState.single())
    whole = optimizer_named("muon").needs_whole(model)
    matrices = {id(m.param) for m in muon_matrices(model)}
    assert whole and {id(p) for p in whole} == matrices
    assert id(model.tok_emb.weight) not in matrices
