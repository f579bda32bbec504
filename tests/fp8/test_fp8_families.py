"""fp8 in GPT-OSS and Gemma 3 (train.precision fp8, fp32 around the GEMMs), every recipe: the
attention's qkv and output projections, the dense MLPs' gate, up and down and GPT-OSS's experts'
grouped GEMMs take fp8 operands; their biases (GPT-OSS's attention, dense MLP and experts) are
added after the fp8 GEMM in fp32, so the experts' clamped SwiGLU is that of the GEMMs' outputs
plus their biases, bit for bit. The embeddings, the output layer, the norms, the router, the
sinks and the soft-capping stay in fp32 (no other GEMM is fp8), and forward and backward reach
every parameter. (Layouts under fp8: tests/moe/layouts.py and tests/commands/test_bench.py.)

An fp8 GEMM's output is within |A_fp8| |B_fp8|^T - |A| |B|^T of the exact product (each cast
value within U_E5M2 of its operand or a subnormal's step: tests/tolerances.py's
fp8_product_magnitude) plus the fp32 sums' reordering, the bias's addition one more term; a
plain fp32 GEMM is within the latter alone, which the projections' outputs exceed (the casts
happened)."""

from __future__ import annotations

import pytest
import torch

from megatronish import ops
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.layers import linear
from megatronish.model import GPT
from megatronish.moe import experts
from megatronish.objectives.registry import sequence_losses
from tests.conftest import CONFIGS
from tests.tolerances import fp8_product_magnitude, reordered_sum_bound

VOCAB = 61
RECIPES = ["tensorwise", "rowwise", "blockwise"]
SMALL = [
    "model.n_layer=2",
    "model.layer_types=[sliding_attention, full_attention]",
    "model.sliding_window=5",
    "model.d_model=32",
    "model.head_dim=8",
    "model.d_ff=48",
    f"model.vocab_size={VOCAB}",
    "model.max_seq_len=16",
    "train.seq_len=16",
    "train.precision=fp8",
    "train.fp8_high_precision=fp32",
]
# GPT-OSS: a dense block (biased gate, up and down), then 4 biased experts behind a clamp that
# binds on some of their activations; Gemma 3: soft-capped scores and logits.
FAMILIES = {
    "gpt_oss": (
        "tiny-gpt-oss.yaml",
        ["model.moe.num_experts=4", "model.moe.d_ff=24", "model.moe.first_k_dense=1"]
        + ["model.swiglu_limit=0.5"],
    ),
    "gemma3": (
        "tiny-gemma3.yaml",
        ["model.query_pre_attn_scalar=8", "model.attn_logit_softcapping=2"]
        + ["model.final_logit_softcapping=3"],
    ),
}


def recorded_step(family: str, recipe: str, monkeypatch):
    """family's small model in `recipe` (its biases drawn, not zeros), after one forward and
    backward; each local_linear call by its weight's id: (x, bias, out, recipe), and each
    fp8_experts call by its stacked weight's id: (rows, counts, out)."""
    config, sets = FAMILIES[family]
    cfg = load_config(CONFIGS / config, [*SMALL, *sets, f"train.fp8_recipe={recipe}"])
    torch.manual_seed(0)
    model = GPT(cfg, derive(cfg, 1), ParallelState.single())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    calls: dict = {"linear": {}, "experts": {}}
    plain_linear, plain_experts = linear.local_linear, experts.fp8_experts

    def spy_linear(x, weight, bias, recipe, split):
        out = plain_linear(x, weight, bias, recipe, split)
        calls["linear"][id(weight)] = (x.detach(), bias, out.detach(), recipe)
        return out

    def spy_experts(rows, weight, counts, recipe, split):
        out = plain_experts(rows, weight, counts, recipe, split)
        calls["experts"][id(weight)] = (rows.detach(), counts, out.detach())
        return out

    monkeypatch.setattr(linear, "local_linear", spy_linear)
    monkeypatch.setattr(experts, "fp8_experts", spy_experts)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    sequence_losses(model, tokens[:, :-1], tokens[:, 1:]).total.backward()
    return model, calls


def assert_fp8_gemm(x, weight, bias, out, what: str) -> None:
    """out = x weight^T (+ bias) with fp8 operands: within the fp8 bound, outside fp32's."""
    a, b = x.reshape(-1, x.shape[-1]), weight.detach()
    out = out.reshape(-1, out.shape[-1]).double()
    shift = 0.0 if bias is None else bias.detach().double()
    exact = a.double() @ b.double().t() + shift
    plain = a.double().abs() @ b.double().abs().t()
    magnitude = fp8_product_magnitude(a, b)
    summed = reordered_sum_bound(a.shape[-1] + 1) * (magnitude + abs(shift))
    err = (out - exact).abs()
    assert (err <= magnitude - plain + summed).all(), what
    assert (err > reordered_sum_bound(a.shape[-1] + 1) * (plain + abs(shift))).any(), what


def expert_runs(rows: torch.Tensor, counts) -> list[torch.Tensor]:
    """rows [R, ...] cut into each local expert's rows (counts [E_l][S])."""
    return list(rows.split([sum(per_expert) for per_expert in counts]))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_projections_and_experts_take_fp8_gemms_with_their_biases_added_in_fp32(
    family, recipe, monkeypatch
):
    model, calls = recorded_step(family, recipe, monkeypatch)
    names = {id(p): name for name, p in model.named_parameters()}
    fp8 = set()
    for key, (x, bias, out, taken) in calls["linear"].items():
        if taken is None:
            continue
        assert taken.name == recipe, names[key]
        assert_fp8_gemm(x, dict(model.named_parameters())[names[key]], bias, out, names[key])
        fp8.add(names[key])
    for key, (rows, counts, out) in calls["experts"].items():
        weight = dict(model.named_parameters())[names[key]]
        for e, (x, y) in enumerate(zip(expert_runs(rows, counts), expert_runs(out, counts))):
            if len(x):
                assert_fp8_gemm(x, weight[e], None, y, f"{names[key]}[{e}]")
        fp8.add(names[key])
    projections = {"attn.qkv", "attn.proj", "mlp.gate", "mlp.up", "mlp.down"}
    want = {f"blocks.{i}.{p}.weight" for i in range(2) for p in projections}
    if family == "gpt_oss":  # block 1's MLP: the experts' stacked weights
        want -= {f"blocks.1.mlp.{p}.weight" for p in ("gate", "up", "down")}
        want |= {f"blocks.1.mlp.experts.{p}" for p in ("gate", "up", "down")}
    assert fp8 == want
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    if family == "gpt_oss":
        assert_expert_biases_added_in_fp32(model.blocks["1"].mlp.experts, calls["experts"])


def assert_expert_biases_added_in_fp32(layer, calls: dict) -> None:
    """The down GEMM's input is the clamped SwiGLU of the gate and up GEMMs' outputs plus each
    row's expert's biases, in fp32, bit for bit; and the clamp binds on some rows."""
    (_, counts, gate), (_, _, up), (hidden, _, _) = (
        calls[id(w)] for w in (layer.gate, layer.up, layer.down)
    )
    offsets = torch.tensor([sum(per_expert) for per_expert in counts]).cumsum(0)
    g = gate + experts.row_bias(layer.gate_bias.detach(), offsets, gate.shape[0])
    u = up + experts.row_bias(layer.up_bias.detach(), offsets, up.shape[0])
    assert hidden.dtype == torch.float32
    assert torch.equal(hidden, ops.activate("clamped_swiglu", g, u, layer.limit))
    assert (g > layer.limit).any() and (u.abs() > layer.limit).any()
