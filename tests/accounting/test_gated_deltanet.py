"""The accounting of Qwen3.5's hybrid (model.layer_types: Gated DeltaNet beside gated full
attention) equals what the model holds and computes: its parameters (the tp 2 counts are held
in tests/model/test_model.py) and the linear-attention layer's GEMM FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatronish.accounting.components import gated_deltanet
from megatronish.accounting.flops import attention_flops_per_token
from megatronish.accounting.layer_time import linear_shapes
from megatronish.accounting.model_state import fp8_layer_params
from megatronish.accounting.parameters import local_parameter_count, parameter_count
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatronish.model import GPT
from megatronish.moe.experts import GroupedExperts
from tests.conftest import CONFIGS
from tests.ranks import run_on_ranks
from tests.tolerances import FP64_REORDER

TINY = CONFIGS / "tiny-qwen3_5.yaml"
MOE = ["model.moe.num_experts=4", "model.moe.d_ff=64"]  # the preset's gated shared expert


@pytest.mark.parametrize("sets", [[], MOE], ids=["dense", "moe"])
def test_parameter_counts_equal_the_numel_of_the_tiny_hybrid(sets):
    """All of them, and under fp8 those of the blocks' fp8 layers (what fp8 casts)."""
    cfg = load_config(TINY, ["model.vocab_size=256", "train.precision=fp8", *sets])  # unpadded
    derived = derive(cfg, 1)
    model = GPT(cfg, derived, ParallelState.single())
    built = sum(p.numel() for p in model.parameters())
    assert parameter_count(cfg, derived) == built
    assert local_parameter_count(cfg, derived) == built
    linears = (ColumnParallelLinear, RowParallelLinear, GroupedExperts)
    fp8 = [m for m in model.blocks.modules() if isinstance(m, linears)]
    assert fp8_layer_params(cfg, derived, 0) == sum(p.numel() for m in fp8 for p in m.parameters())


def test_linear_attention_flops_equal_the_gemms_of_its_forward():
    """The projections (mm) and the chunked rule (bmm) as torch's flop counter counts them, on
    two chunks of 64 tokens; the convolution is not a matmul and not counted."""
    cfg = load_config(TINY, ["model.vocab_size=256"])
    derived, model = derive(cfg, 1), cfg.model
    layer = GPT(cfg, derived, ParallelState.single()).blocks["0"].attn
    batch, seq = 2, 128
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(batch, seq, model.d_model))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    tokens = batch * seq
    assert counts["aten.mm"] == 2 * tokens * gated_deltanet.matmul_params(model, derived)
    assert counts["aten.bmm"] == tokens * gated_deltanet.rule_gemm_flops_per_token(model)
    # Only the one full-attention block counts attention's s^2 terms.
    full = 2 * cfg.train.seq_len * model.n_head * 2 * derived.head_dim
    linear = 3 * gated_deltanet.rule_flops_per_token(model)
    assert attention_flops_per_token(cfg, derived) == full + linear


def test_the_delta_rule_kernel_is_timed_linear_in_the_sequence_unlike_attention():
    """On an H100 at Qwen3.5-9B's shapes the chunked rule's time (its own roofline kind) grows
    with s, attention's with s^2: doubling seq_len doubles one and quadruples the other."""
    from megatronish.accounting.hardware import GPUS
    from megatronish.accounting.layer_time import layer_time
    from megatronish.accounting.roofline import GPU_EFFICIENCY

    overhead = GPU_EFFICIENCY.kernel_overhead_s
    cores = {}
    for seq in (4096, 8192):
        cfg = load_config(CONFIGS / "qwen3_5-9b.yaml", [f"train.seq_len={seq}"])
        derived = derive(cfg, 8)
        cores[seq] = [
            layer_time(cfg, derived, GPUS["H100"], GPU_EFFICIENCY, False, "flash", None, kind)
            .attention_forward - overhead
            for kind in ("gated_deltanet", "mha")
        ]  # fmt: skip
    linear, full = (cores[8192][i] / cores[4096][i] for i in (0, 1))
    assert linear == pytest.approx(2, rel=FP64_REORDER)
    assert full == pytest.approx(4, rel=FP64_REORDER)


WEIGHTS = {
    "linear_qkv": ["blocks.0.attn.in_proj_qkv"],
    "linear_z": ["blocks.0.attn.in_proj_z"],
    "linear_b": ["blocks.0.attn.in_proj_b"],
    "linear_a": ["blocks.0.attn.in_proj_a"],
    "linear_out": ["blocks.0.attn.out_proj"],
    "qkv": ["blocks.3.attn.qkv"],
    "proj": ["blocks.3.attn.proj"],
    "shared_up": ["blocks.3.mlp.shared.gate", "blocks.3.mlp.shared.up"],
    "shared_down": ["blocks.3.mlp.shared.down"],
}
"""The weights of each GEMM the plan names, in tiny-qwen3_5 with experts (gate and up side by
side: one GEMM twice as wide)."""
LATENT = {
    "q_down": ["blocks.0.attn.q_a"],
    "qkv": ["blocks.0.attn.q_b"],
    "kv_down": ["blocks.0.attn.kv_a"],
    "kv_up": ["blocks.0.attn.kv_b"],
    "proj": ["blocks.0.attn.proj"],
    "shared_up": ["blocks.1.mlp.shared.gate", "blocks.1.mlp.shared.up"],
    "shared_down": ["blocks.1.mlp.shared.down"],
}
"""The same in tiny-deepseek-v3 (multi-head latent attention, two shared experts)."""
GEMM_CASES = {
    "hybrid": (
        "tiny-qwen3_5.yaml",
        [*MOE, "model.moe.shared_expert=false", "model.moe.n_shared_experts=2"],
        WEIGHTS,
    ),
    "latent": ("tiny-deepseek-v3.yaml", ["model.moe.n_shared_experts=2"], LATENT),
}


def _gemms_and_weights(rank: int, tp: int, case: str) -> tuple[dict, dict]:
    """(the plan's forward GEMM (n, k) of each linear the case names, the (out, in) of the
    weights the model builds for it on this tp rank)."""
    path, sets, names = GEMM_CASES[case]
    cfg = load_config(CONFIGS / path, ["model.vocab_size=256", f"parallel.tp={tp}", *sets])
    derived = derive(cfg, tp)
    ps = ParallelState.from_world(tp=tp, dp=1) if tp > 1 else ParallelState.single()
    modules = dict(GPT(cfg, derived, ps).named_modules())
    shapes = {name: shape[1:] for name, shape in linear_shapes(cfg, derived).items()}
    weights = {}
    for name, parts in names.items():
        rows = sum(modules[part].weight.shape[0] for part in parts)
        weights[name] = (rows, modules[parts[0]].weight.shape[1])
    return {name: shapes.get(name) for name in names}, weights


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_the_plans_gemm_shapes_are_those_of_the_weights_the_model_builds(case, tp):
    """Each linear of the plan's GEMM table (layer_time.linear_shapes) is as wide and as deep as
    the weight it multiplies on one tp rank: a linear-attention block's projections beside a
    full-attention block's (its gated queries doubling q), multi-head latent attention's down-
    and up-projections, the shared expert at its own size; no shared expert, no such GEMM."""
    if tp == 1:
        gemms, weights = _gemms_and_weights(0, 1, case)
    else:
        gemms, weights = run_on_ranks(_gemms_and_weights, tp, case, timeout=120)[0]
    assert gemms == weights
    plain = load_config(CONFIGS / "tiny-moe.yaml", ["model.vocab_size=256"])
    assert not {"shared_up", "shared_down"} & set(linear_shapes(plain, derive(plain, 1)))


@pytest.mark.parametrize("sequence_parallel", ["true", "false"])
def test_a_hybrids_decomposed_tp_collectives_run_under_their_own_blocks_gemms(sequence_parallel):
    """With parallel.tp_comm_overlap, the three linear-attention blocks' collectives of
    tiny-qwen3_5 run under their own GEMMs (the input's under the four input projections, which
    share it, out_proj's under out_proj), the full-attention block's under qkv and proj: per
    block and micro-batch, each reduce-scatter and all-gather in t - 1 ring hops, each
    all-reduce in t chunks."""
    from megatronish.accounting.collectives import collectives_per_step
    from megatronish.accounting.hardware import GPUS
    from megatronish.accounting.layer_time import linear_gemms
    from megatronish.accounting.roofline import GPU_EFFICIENCY

    sets = ["parallel.tp=2", "parallel.tp_comm_overlap=true"]
    sets.append(f"parallel.sequence_parallel={sequence_parallel}")
    cfg = load_config(TINY, ["model.vocab_size=256", *sets])
    derived = derive(cfg, 2)
    gemms = linear_gemms(cfg, derived, GPUS["H100"], GPU_EFFICIENCY)
    inputs = [gemms[f"linear_{name}"] for name in ("qkv", "z", "b", "a")]
    assert gemms["linear_in"] == sum(inputs)
    calls: dict[str, int] = {}
    for op in collectives_per_step(cfg, derived):
        if op.group == "tp" and op.under:
            calls[op.under] = calls.get(op.under, 0) + op.count
    assert set(calls) <= set(gemms)
    m, tp = derived.grad_accum_steps, derived.tp
    pieces = tp - 1 if sequence_parallel == "true" else tp  # ring hops, or all-reduce chunks
    if sequence_parallel == "true":  # qkv's gather (again in backward) and reduce-scatter
        per_block = {"qkv": 3, "proj": 1, "proj_backward": 1}
        per_block |= {"linear_in": 2, "linear_out": 1, "linear_out_backward": 1}
    else:  # the projections' forward all-reduces alone
        per_block = {"proj": 1, "linear_out": 1}
    blocks = {name: 3 if name.startswith("linear") else 1 for name in per_block}
    attention = {name: n for name, n in calls.items() if name in per_block}
    assert attention == {n: c * blocks[n] * m * pieces for n, c in per_block.items()}
