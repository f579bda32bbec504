"""The mixture-of-experts layer alone: the router and its losses equal their formulas
(Switch Transformer eq. 4, ST-MoE's z-loss), capacity keeps the first choices first,
dispatch then combine with weights 1 / top_k gives back the input and its gradient exactly,
and the layer at ep = 2 and tp 2 x ep 2 equals the one-process layer, forward and every
gradient, in float64 (dropless; also with an expert that gets no tokens, and with an ep rank
that receives none at all)."""

from __future__ import annotations

import math

import pytest
import torch

from megatronish.layers.plan import PLAIN
from megatronish.layers.roles import role
from megatronish.moe.dispatch import capacity_keep, combine, dispatch, make_plan
from megatronish.moe.router import balancing_loss_share, route, z_loss_share
from tests.ranks import run_on_ranks
from tests.tolerances import EXACT, FP32_FEW_OPS_REL, FP32_TINY_ABS, FP64_REORDER

E, K, H, F = 4, 2, 8, 12
B, S = 2, 5
# How the router treats the experts: "spread" starves expert 3 only; "skewed" starves 2 and 3,
# so at ep = 2 the rank holding them receives no rows at all.
CASES = {"spread": (3,), "skewed": (2, 3)}


def _config(tp: int = 1, dp: int = 1, ep: int = 1):
    from megatronish.config import load_config

    return load_config(
        None,
        [
            "model.arch=llama",
            f"model.d_model={H}",
            "model.n_head=2",
            "model.n_layer=1",
            f"model.moe.num_experts={E}",
            f"model.moe.top_k={K}",
            f"model.moe.d_ff={F}",
            "model.vocab_size=64",
            "train.micro_batch_size=1",
            f"train.global_batch_size={dp}",
            f"parallel.tp={tp}",
            f"parallel.dp={dp}",
            f"parallel.ep={ep}",
        ],
    )


def _weights(case: str) -> dict[str, torch.Tensor]:
    """Full float64 weights; the starved experts' router rows make their logits very low (the
    inputs are positive)."""
    gen = torch.Generator().manual_seed(7)
    router = torch.randn(E, H, generator=gen, dtype=torch.float64)
    for expert in CASES[case]:
        router[expert] = -5.0
    return {
        "router": router,
        "gate": torch.randn(E, F, H, generator=gen, dtype=torch.float64) * 0.3,
        "up": torch.randn(E, F, H, generator=gen, dtype=torch.float64) * 0.3,
        "down": torch.randn(E, H, F, generator=gen, dtype=torch.float64) * 0.3,
    }


def _tokens(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.rand(B, S, H, generator=gen, dtype=torch.float64) + 0.1
    return x, torch.randn(B, S, H, generator=gen, dtype=torch.float64)


def _layer(cfg, world: int, ps, weights):
    """The layer at this rank's tp and ep, holding its blocks of the full weights."""
    from megatronish.config import derive
    from megatronish.moe import MoELayer

    derived = derive(cfg, world, vocab_size=64)
    sp = cfg.parallel.sequence_parallel and derived.tp > 1
    layer = MoELayer(cfg.model, derived, ps, PLAIN, cfg.kernels.backend, sp).double().train()
    ids = list(role(layer.experts.gate).expert_ids)
    tp, rank = derived.tp, ps.tp_rank
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        layer.experts.gate.copy_(weights["gate"][ids].chunk(tp, dim=1)[rank])
        layer.experts.up.copy_(weights["up"][ids].chunk(tp, dim=1)[rank])
        layer.experts.down.copy_(weights["down"][ids].chunk(tp, dim=2)[rank])
    return layer


def _run(layer, dp_rank: int) -> dict[str, torch.Tensor]:
    """Forward and backward (router losses included) on dp rank dp_rank's tokens."""
    x, dout = _tokens(dp_rank)
    x.requires_grad_(True)
    out = layer(x)
    out.backward(dout)
    grads = {"out": out.detach(), "x": x.grad, "router": layer.router.weight.grad}
    for name in ("gate", "up", "down"):
        grads[name] = getattr(layer.experts, name).grad
    return grads


def _identity_round_trip(x: torch.Tensor, experts, ep: int, group) -> tuple:
    """dispatch then combine, no expert in between, weights 1 / top_k: (output, x's grad)."""
    tokens = x.reshape(-1, H).clone().requires_grad_(True)
    plan = make_plan(experts, None, E, ep, group)
    rows = dispatch(tokens, plan, group)
    weights = torch.full(experts.shape, 1.0 / K, dtype=torch.float64)
    out = combine(rows, plan, weights, tokens.shape[0], group)
    upstream = torch.arange(out.numel(), dtype=torch.float64).view_as(out)
    out.backward(upstream)
    return out.detach(), tokens.grad, upstream, plan.recv_splits


def _on_ranks(rank, world, tp, dp, ep):
    from megatronish.distributed.layout import ParallelState
    from megatronish.moe.router import router_logits

    ps = ParallelState.from_world(tp, dp, 1, 1, ep)
    cfg = _config(tp, dp, ep)
    results = {}
    for case in CASES:
        weights = _weights(case)
        results[case] = _run(_layer(cfg, world, ps, weights), ps.dp_rank)
        x, _ = _tokens(ps.dp_rank)
        experts = route(router_logits(x.reshape(-1, H), weights["router"]), K, "softmax_topk")
        results[f"{case} identity"] = _identity_round_trip(x, experts.experts, ep, ps.ep_group)
        results[f"{case} rank"] = (ps.tp_rank, ps.dp_rank, ps.ep_rank, ps.ep)
    return results


def _reference(case: str, dp: int) -> list[dict[str, torch.Tensor]]:
    """The one-process layer run on each dp rank's tokens (each its own micro-batch, with its
    own router losses): outputs and every gradient, per dp rank."""
    from megatronish.distributed.layout import ParallelState

    layer = _layer(_config(), 1, ParallelState.single(), _weights(case))
    runs = []
    for dp_rank in range(dp):
        layer.zero_grad(set_to_none=True)
        runs.append(_run(layer, dp_rank))
    return runs


_PARALLEL: dict = {}


def parallel(tp: int, dp: int, ep: int) -> list[dict]:
    key = (tp, dp, ep)
    if key not in _PARALLEL:
        _PARALLEL[key] = run_on_ranks(_on_ranks, tp * dp, tp, dp, ep, timeout=120)
    return _PARALLEL[key]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=FP32_FEW_OPS_REL, atol=FP32_TINY_ABS, msg=what
    )


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["ep2", "tp2 ep2"])
def test_moe_layer_at_ep2_and_tp2_ep2_equals_one_process_float64(layout, case):
    tp = 2 if layout.startswith("tp2") else 1
    ranks = parallel(tp, 2, 2)
    ref = _reference(case, 2)
    for result in ranks:
        tp_rank, dp_rank, ep_rank, ep = result[f"{case} rank"]
        got, want = result[case], ref[dp_rank]
        for name in ("out", "x", "router"):
            _close(got[name], want[name], f"{layout} {case} dp rank {dp_rank}: {name}")
        ids = list(range(ep_rank * E // ep, (ep_rank + 1) * E // ep))
        for name, dim in (("gate", 1), ("up", 1), ("down", 2)):
            summed = sum(run[name] for run in ref)[ids].chunk(tp, dim=dim)[tp_rank]
            _close(got[name], summed, f"{layout} {case} ep rank {ep_rank}: {name} gradient")


@pytest.mark.parametrize("case", list(CASES))
def test_dispatch_then_combine_with_weights_one_over_top_k_is_the_identity(case):
    """At ep = 2 (one process per rank, zero-size splits included) and in one process."""
    received = []
    for result in parallel(1, 2, 2):
        out, grad, upstream, recv_splits = result[f"{case} identity"]
        x, _ = _tokens(result[f"{case} rank"][1])
        assert torch.equal(out, x.reshape(-1, H)) and torch.equal(grad, upstream)
        received.append(sum(recv_splits))
    if case == "skewed":
        assert received[1] == 0  # experts 2 and 3 get nothing: ep rank 1 receives no rows
    x, _ = _tokens(0)
    tokens = x.reshape(-1, H)
    experts = torch.randint(0, E - 1, (tokens.shape[0], K), generator=torch.Generator())
    out, grad, upstream, _ = _identity_round_trip(x, experts, 1, None)
    assert torch.equal(out, tokens) and torch.equal(grad, upstream)


def test_router_top_k_weights_and_losses_equal_their_formulas():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, E, generator=gen, dtype=torch.float64)
    mixtral = route(logits, K, "softmax_topk")
    other = route(logits, K, "topk_softmax")
    assert torch.equal(mixtral.experts, other.experts)
    torch.testing.assert_close(mixtral.weights, other.weights, rtol=FP64_REORDER, atol=EXACT)
    rows = logits.tolist()
    for t, row in enumerate(rows):
        order = sorted(range(E), key=lambda i: -row[i])[:K]
        assert mixtral.experts[t].tolist() == order
        exps = [math.exp(row[i]) for i in order]
        assert mixtral.weights[t].tolist() == pytest.approx([e / sum(exps) for e in exps])
    # Switch eq. 4: N * sum_i f_i P_i, f_i the fraction of routed assignments to expert i
    tokens = len(rows)
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in rows]
    chosen = mixtral.experts.tolist()
    f = [sum(row.count(i) for row in chosen) / (tokens * K) for i in range(E)]
    p = [sum(prob[i] for prob in probs) / tokens for i in range(E)]
    expected = E * sum(fi * pi for fi, pi in zip(f, p))
    counts = torch.bincount(mixtral.experts.reshape(-1), minlength=E)
    assert float(balancing_loss_share(mixtral.probs, counts, tokens, K)) == pytest.approx(expected)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in rows) / tokens
    assert float(z_loss_share(logits, tokens)) == pytest.approx(z)
    balanced = torch.full((8, E), 1.0 / E, dtype=torch.float64)
    assert float(balancing_loss_share(balanced, torch.full((E,), 4), 8, K)) == pytest.approx(1.0)


def test_capacity_keeps_first_choices_first_then_token_order():
    gen = torch.Generator().manual_seed(5)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(11)])
    capacity = 3
    keep = capacity_keep(experts, E, capacity)
    taken = [0] * E
    expected = torch.zeros_like(keep)
    for slot in range(K):
        for t in range(experts.shape[0]):
            e = int(experts[t, slot])
            if taken[e] < capacity:
                taken[e] += 1
                expected[t, slot] = True
    assert torch.equal(keep, expected)
