"""DeepSeek-V3's routing in-process: the sigmoid router (with a routing bias, group-limited
routing and the routed scaling factor) chooses the experts and gives the weights of
transformers' DeepseekV3TopkRouter on random inputs; the sequence-wise balancing loss equals
its formula computed by hand; the bias moves by the speed towards balance."""

from __future__ import annotations

import pytest
import torch

from megatronish.moe.balance import load_spread, update_biases
from megatronish.moe.router import Grouping, route, router_logits, sequence_loss_share
from tests.tolerances import EXACT, FP32_FEW_OPS_REL, FP64_REORDER

E, H, T = 16, 12, 40


@pytest.mark.parametrize(("n_group", "topk_group", "top_k"), [(1, 1, 3), (4, 2, 4), (8, 3, 2)])
def test_sigmoid_router_equals_transformers_deepseek_v3_router(n_group, topk_group, top_k):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(n_group)
    config = DeepseekV3Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    theirs = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(E, H, generator=gen))
        theirs.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    x = torch.randn(T, H, generator=gen)
    _, want_weights, want_experts = theirs(x)
    grouping = Grouping(n_group, topk_group, 2.5)
    logits = router_logits(x, theirs.weight)
    ours = route(logits, top_k, "sigmoid", theirs.e_score_correction_bias, grouping)
    # transformers' top-k is unsorted: compare each token's (expert, weight) pairs by expert.
    want_order = want_experts.argsort(dim=-1)
    got_order = ours.experts.argsort(dim=-1)
    assert torch.equal(ours.experts.gather(1, got_order), want_experts.gather(1, want_order))
    torch.testing.assert_close(
        ours.weights.gather(1, got_order),
        want_weights.gather(1, want_order),
        rtol=FP32_FEW_OPS_REL,
        atol=EXACT,
    )
    scores = torch.sigmoid(logits)
    torch.testing.assert_close(ours.probs, scores / scores.sum(-1, keepdim=True))
    if n_group > 1:  # the groups really limit the choice
        groups = ours.experts // (E // n_group)
        assert all(len(set(row)) <= topk_group for row in groups.tolist())


def test_sequence_loss_equals_its_formula_per_sequence_averaged():
    gen = torch.Generator().manual_seed(0)
    b, s, k = 3, 10, 2
    logits = torch.randn(b * s, E, generator=gen, dtype=torch.float64)
    routing = route(logits, k, "sigmoid", torch.zeros(E, dtype=torch.float64), Grouping())
    experts = routing.experts.view(b, s * k)
    counts = torch.zeros(b, E, dtype=torch.int64).scatter_add_(1, experts, torch.ones_like(experts))
    got = sequence_loss_share(routing.probs.view(b, s, E), counts, s, k)
    want = 0.0
    for seq in range(b):
        scores = torch.sigmoid(logits.view(b, s, E)[seq])
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        f = [E / (k * s) * (experts[seq] == i).sum().item() for i in range(E)]
        want += sum(f[i] * p[i].item() for i in range(E)) / b
    assert got.item() == pytest.approx(want, rel=FP64_REORDER)


def test_bias_moves_by_the_speed_towards_the_mean_load():
    class Layer:  # what update_biases reads of a MoE layer
        class router:  # noqa: N801
            bias = torch.zeros(4)

    loads = torch.tensor([[6, 2, 4, 4]])
    update_biases({0: Layer}, loads, (0,), 0.125)
    assert Layer.router.bias.tolist() == [-0.125, 0.125, 0.0, 0.0]
    assert load_spread(loads) == {"moe_load_spread": 1.5, "moe_load_spread_mean": 1.5}
