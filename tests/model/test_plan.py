"""The modules below GPT are built from their model.* section and their block's plan
(megatronish.model.plan), which alone reads the kernels, parallel and train sections."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import megatronish
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState, RNGTracker
from megatronish.model import GPT
from megatronish.model.block import Block
from megatronish.model.plan import block_plan
from tests.conftest import CONFIGS

PACKAGE = Path(megatronish.__file__).parent
# GPT, the root, builds the plans; autocast and the MoE routing balancer run around the step.
READ_THE_RUN_CONFIG = {"model/gpt.py", "model/plan.py", "model/precision.py", "moe/balance.py"}


def _names_imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "megatronish.config"
        for alias in node.names
    }


def test_no_module_below_gpt_takes_the_run_config():
    modules = sorted((PACKAGE / "model").glob("*.py")) + sorted((PACKAGE / "moe").glob("*.py"))
    taking = [
        str(path.relative_to(PACKAGE))
        for path in modules
        if str(path.relative_to(PACKAGE)) not in READ_THE_RUN_CONFIG
        and "Config" in _names_imported(path)
    ]
    assert taking == []


def test_a_block_built_from_its_plan_is_the_block_gpt_builds():
    sets = ["model.arch=llama", "model.n_layer=1", "model.vocab_size=61", "model.d_model=32"]
    sets += ["train.activation_checkpointing=selective", "parallel.sequence_parallel=true"]
    cfg = load_config(CONFIGS / "tiny.yaml", sets)
    derived, ps = derive(cfg, 1), ParallelState.single()
    plan = block_plan(cfg, derived, ps, RNGTracker(cfg.train.seed, 0, ps.device), 0)
    # sequence parallelism is on at tp > 1 only; the dense linears take the setting as it is
    assert plan.linear_sequence_parallel and not plan.sequence_parallel
    assert plan.selective_recompute and plan.backend == cfg.kernels.backend
    assert plan.components == cfg.model.components and not plan.moe
    torch.manual_seed(0)
    block = Block(cfg.model, plan)
    ours = {name: p.shape for name, p in block.named_parameters()}
    gpt = GPT(cfg, derived, ps)
    theirs = {name: p.shape for name, p in gpt.blocks["0"].named_parameters()}
    assert ours == theirs
    assert block.attn.selective_checkpoint and block.attn.rotary and block.mlp.gated
