"""Muon's accounting (megatronish.accounting.muon) from the same components as the model: the
matrices it lists are those the optimizer takes from a built model (optim.muon_matrices), shape
for shape, for every attention and MLP kind; the memory estimate keeps one fp32 buffer per
Muon matrix element instead of AdamW's two; the Newton-Schulz FLOPs follow the iteration's
GEMMs; and `check` says which parameters each optimizer takes."""

from __future__ import annotations

import pytest

from megatronish.accounting.collectives import collectives_per_step
from megatronish.accounting.model_state import model_state_bytes
from megatronish.accounting.muon import (
    local_elements,
    newton_schulz_flops,
    stage_matrices,
)
from megatronish.accounting.parameters import local_parameter_count
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.optim.muon_matrices import muon_matrices
from tests.conftest import CONFIGS, invoke_cli

MUON = ["optim.name=muon", "model.vocab_size=257"]
SMALL = ["model.n_layer=2", "model.d_model=32", "model.max_seq_len=16", "train.seq_len=16"]
CASES = {
    "llama gqa mtp": ("tiny.yaml", [*SMALL, "model.arch=llama", "model.n_kv_head=2"]),
    "gpt2": ("tiny.yaml", [*SMALL, "model.arch=gpt2", "model.mtp_depth=1"]),
    "qwen3_5 hybrid moe": ("tiny-qwen3_5.yaml", []),
    "deepseek_v3 mla moe mtp": ("tiny-deepseek-v3.yaml", ["model.mtp_depth=1"]),
}


def _config(case: str, *extra: str):
    name, sets = CASES[case]
    return load_config(CONFIGS / name, [*sets, *MUON, *extra])


@pytest.mark.parametrize("case", list(CASES))
def test_the_accounted_muon_matrices_are_those_the_optimizer_takes_from_the_model(case):
    cfg = _config(case)
    derived = derive(cfg, 1, vocab_size=257)
    model = GPT(cfg, derived, ParallelState.single())
    built = sorted(tuple(m.local(m.param).shape) for m in muon_matrices(model) for _ in [0])
    accounted = sorted(
        (m.rows, m.cols) for m in stage_matrices(cfg, derived, 0) for _ in range(m.count)
    )
    assert accounted == built


def test_muons_state_is_one_fp32_buffer_per_matrix_element_and_adamws_two_for_the_rest():
    cfg = _config("llama gqa mtp")
    adamw = load_config(CONFIGS / "tiny.yaml", [*CASES["llama gqa mtp"][1], MUON[1]])
    derived = derive(cfg, 1, vocab_size=257)
    muon = local_elements(stage_matrices(cfg, derived, 0), 1)
    params = local_parameter_count(cfg, derived)
    assert 0 < muon < params
    assert model_state_bytes(cfg, derived, 0)["optimizer"] == 4 * muon + 8 * (params - muon)
    assert model_state_bytes(adamw, derived, 0)["optimizer"] == 8 * params


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_under_zero_a_rank_keeps_the_momentum_of_its_own_matrices_and_each_matrix_whole(zero):
    cfg = _config("llama gqa mtp", "parallel.dp=2", f"optim.zero={zero}")
    derived = derive(cfg, 2, vocab_size=257)
    muon = local_elements(stage_matrices(cfg, derived, 0), 1)
    params = local_parameter_count(cfg, derived)
    state = model_state_bytes(cfg, derived, 0)
    # each matrix's momentum on the one rank of two that owns it; AdamW's moments sharded
    assert state["optimizer"] == (4 * muon + 8 * (params - muon)) / 2
    # ZeRO-2 and 3 keep the matrices' gradients (3: their weights) whole, the rest halved
    halved = 4 * ((params - muon) / 2 + muon)
    assert state["grads"] == (halved if zero >= 2 else 4 * params)
    if zero == 3:
        copies = 2 * params if cfg.train.bf16_autocast else 0  # autocast's bf16 weights
        assert state["weights"] - copies == halved


def test_under_zero_1_muons_matrices_reduced_to_their_owner_send_over_dp_what_adamw_sends():
    # per matrix a reduce to its owner and the owner's broadcast, (n-1)/n of it each, in place
    # of ZeRO-1's reduce-scatter and all-gather: dp_bytes is n / (n-1) x what a rank sends
    def dp_bytes(cfg) -> int:
        ops = collectives_per_step(cfg, derive(cfg, 2, vocab_size=257), 0)
        return sum(
            op.payload * op.count * (2 if op.kind == "all_reduce" else 1)
            for op in ops
            if op.group == "dp"
        )

    sets = ["parallel.dp=2", "optim.zero=1"]
    muon = _config("llama gqa mtp", *sets)
    adamw = load_config(CONFIGS / "tiny.yaml", [*CASES["llama gqa mtp"][1], MUON[1], *sets])
    derived = derive(muon, 2, vocab_size=257)
    reduced = sum(
        op.payload for op in collectives_per_step(muon, derived, 0) if op.kind == "reduce"
    )
    assert reduced == 4 * local_elements(stage_matrices(muon, derived, 0), 1)
    assert dp_bytes(muon) == dp_bytes(adamw)


def test_newton_schulz_flops_count_the_iterations_gemms_on_the_wide_orientation():
    # per step on [m, n], m <= n: X X^T 2 m^2 n, A A 2 m^3, B X 2 m^2 n
    assert newton_schulz_flops(3, 5, 1) == 2 * 9 * 5 + 2 * 27 + 2 * 9 * 5
    assert newton_schulz_flops(5, 3, 5) == newton_schulz_flops(3, 5, 5) == 5 * 234


def test_check_says_which_parameters_each_optimizer_takes():
    args = ["--config", str(CONFIGS / "tiny.yaml")]
    for s in [*CASES["llama gqa mtp"][1], "optim.name=muon"]:
        args += ["--set", s]
    result = invoke_cli("check", *args)
    assert result.returncode == 0, result.stderr
    lines = [x for x in result.stdout.splitlines() if x.startswith(("muon:", "adamw:"))]
    assert len(lines) == 2, result.stdout
    assert "attn.q" in lines[0] and "mlp.down" in lines[0] and "Newton-Schulz" in lines[0]
    assert "embedding" in lines[1] and "norms" in lines[1]


def test_plan_times_newton_schulz_and_searches_muon_at_zero_1_as_adamw():
    from megatronish.accounting.hardware import device_named
    from megatronish.accounting.step_time import step_time
    from megatronish.commands.plan_report import searched_zero

    cfg = _config("llama gqa mtp")
    adamw = load_config(CONFIGS / "tiny.yaml", [*CASES["llama gqa mtp"][1], MUON[1]])
    derived = derive(cfg, 1, vocab_size=257)
    device = device_named("H100")
    muon_s = step_time(cfg, derived, device).breakdown["optimizer"]
    assert muon_s > step_time(adamw, derived, device).breakdown["optimizer"]
    assert searched_zero(cfg) == 1 and searched_zero(adamw) == 1
