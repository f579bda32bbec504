"""Each tensor-parallel layer equals the single-device computation with the full weights,
forward and every gradient, on 2 and 4 gloo ranks at odd sizes; with an fp8 recipe, the
single-device fp8 GEMMs (torchao's, tests/fp8) to the fp32 rounding of their sums (GEMMs of
other shapes may add in another order, and the tp ranks' partial sums add up); the same with the
tokens split over the ranks (context parallelism: the scales spanning the tokens reduced
over them)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from megatronish.distributed import comm
from megatronish.fp8 import RECIPES, Parts, Split, TokenGroups, fp8_linear
from megatronish.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mappings,
    vocab_parallel_cross_entropy,
)
from megatronish.layers.linear import column_parallel_linear
from megatronish.layers.plan import LinearPlan
from tests.ranks import run_on_ranks
from tests.tolerances import (
    FP32_REORDER,
    FP64_REORDER,
    U_FP32,
    fp8_product_magnitude,
    reordered_sum_bound,
)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item() + 1e-12
    assert err / scale < FP32_REORDER, f"{what}: relative error {err / scale:.2e}"


def _column(rank, world, gather_output, sequence_parallel):
    torch.manual_seed(0)
    batch, seq, d_in, d_out = 3, 4 * world + 1 if not sequence_parallel else 2 * world, 7, 6 * world
    x = torch.randn(batch, seq, d_in)
    w = torch.randn(d_out, d_in)
    b = torch.randn(d_out)
    grad_out = torch.randn(batch, seq, d_out)
    layer = ColumnParallelLinear(
        d_in, d_out, gather_output=gather_output, sequence_parallel=sequence_parallel
    )
    with torch.no_grad():
        layer.weight.copy_(w.chunk(world)[rank])
        layer.bias.copy_(b.chunk(world)[rank])
    x_local = x.chunk(world, dim=1)[rank] if sequence_parallel else x
    x_local = x_local.clone().requires_grad_()
    out = layer(x_local)
    g = grad_out if gather_output else grad_out.chunk(world, dim=-1)[rank]
    out.backward(g)
    ref_x = x.clone().requires_grad_()
    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = F.linear(ref_x, ref_w, ref_b)
    ref.backward(grad_out)
    ref_out = ref if gather_output else ref.chunk(world, dim=-1)[rank]
    ref_dx = ref_x.grad.chunk(world, dim=1)[rank] if sequence_parallel else ref_x.grad
    assert_close(out, ref_out, "output")
    assert_close(x_local.grad, ref_dx, "input grad")
    assert_close(layer.weight.grad, ref_w.grad.chunk(world)[rank], "weight grad")
    assert_close(layer.bias.grad, ref_b.grad.chunk(world)[rank], "bias grad")
    return True


def _row(rank, world, input_is_parallel, sequence_parallel):
    torch.manual_seed(1)
    batch, seq, d_in, d_out = 2, 2 * world if sequence_parallel else 5, 3 * world, 11
    x = torch.randn(batch, seq, d_in)
    w, b = torch.randn(d_out, d_in), torch.randn(d_out)
    grad_out = torch.randn(batch, seq, d_out)
    layer = RowParallelLinear(
        d_in, d_out, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel
    )
    with torch.no_grad():
        layer.weight.copy_(w.chunk(world, dim=1)[rank])
        layer.bias.copy_(b)
    x_in = x.chunk(world, dim=-1)[rank] if input_is_parallel else x
    x_in = x_in.clone().requires_grad_()
    out = layer(x_in)
    g = grad_out.chunk(world, dim=1)[rank] if sequence_parallel else grad_out
    out.backward(g)
    bias_grad = layer.bias.grad.clone()
    if sequence_parallel:  # the trainer sums these over the tp group
        comm.all_reduce(bias_grad, None)
    ref_x = x.clone().requires_grad_()
    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = F.linear(ref_x, ref_w, ref_b)
    ref.backward(grad_out)
    ref_out = ref.chunk(world, dim=1)[rank] if sequence_parallel else ref
    ref_dx = ref_x.grad.chunk(world, dim=-1)[rank] if input_is_parallel else ref_x.grad
    assert_close(out, ref_out, "output")
    assert_close(x_in.grad, ref_dx, "input grad")
    assert_close(layer.weight.grad, ref_w.grad.chunk(world, dim=1)[rank], "weight grad")
    assert_close(bias_grad, ref_b.grad, "bias grad")
    return True


def _embedding(rank, world):
    torch.manual_seed(2)
    vocab, dim = 5 * world, 9
    ids = torch.randint(0, vocab, (3, 7))
    w = torch.randn(vocab, dim)
    grad_out = torch.randn(3, 7, dim)
    layer = VocabParallelEmbedding(vocab, dim)
    with torch.no_grad():
        layer.weight.copy_(w.chunk(world)[rank])
    out = layer(ids)
    out.backward(grad_out)
    ref_w = w.clone().requires_grad_()
    ref = F.embedding(ids, ref_w)
    ref.backward(grad_out)
    assert_close(out, ref, "output")
    assert_close(layer.weight.grad, ref_w.grad.chunk(world)[rank], "weight grad")
    return True


def _cross_entropy(rank, world):
    torch.manual_seed(3)
    vocab = 13 * world
    logits = torch.randn(4, 5, vocab) * 3
    target = torch.randint(0, vocab, (4, 5))
    target[0, 0] = -100
    target[2, 3] = -100
    grad_out = torch.rand(4, 5)
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    loss.backward(grad_out)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none")
    ref = ref.view(4, 5)
    ref.backward(grad_out)
    assert_close(loss, ref, "loss")
    assert_close(local.grad, ref_logits.grad.chunk(world, dim=-1)[rank], "logits grad")
    assert loss[0, 0] == 0 and local.grad[0, 0].abs().max() == 0
    return True


def _mappings_bytes(rank, world):
    """The f/g operators move exactly one all-reduce each, in the direction the math needs."""
    x = torch.randn(2, 3, 4, requires_grad=True)
    with comm.CommCounter() as counter:
        y = mappings.copy_to_tensor_parallel_region(x)
        assert counter.calls["all_reduce"] == 0
        y.sum().backward()
        assert counter.calls["all_reduce"] == 1
    with comm.CommCounter() as counter:
        z = mappings.reduce_from_tensor_parallel_region(x)
        z.sum().backward()
        assert counter.calls["all_reduce"] == 1
        assert counter.payload_bytes["all_reduce"] == x.numel() * 4
        assert counter.sent_bytes["all_reduce"] == x.numel() * 4 * 2 * (world - 1) / world
    return True


def _assert_summed_close(got, want, a, b, what: str) -> None:
    """got (partial sums over tp added up) and want (one sum) of the fp8 product a b^T (plus a
    bias) differ only by fp32 rounding: each sum of K products is within K u of the exact one
    (u = 2^-24), plus a rounding of the partials' addition and of the bias's."""
    k = a.shape[-1]
    a, b = a.reshape(-1, k), b.reshape(-1, k)
    magnitude = fp8_product_magnitude(a, b).view(want.shape)
    bound = reordered_sum_bound(k + 1) * magnitude + 2 * U_FP32 * want.detach().double().abs()
    err = (got.double() - want.double()).abs()
    assert (err <= bound).all(), f"{what}: error {err.max():.3e} beyond the fp32 summation bound"


def _qkv_sizes(recipe_name: str, world: int) -> tuple[int, int, tuple[int, int, int]]:
    """(d_in, d_mid, out_parts) of the fp8 layout checks' column layer, three logical matrices
    (q, k, v) per unit of its rows, each rank whole units: blockwise's of 64 rows (a head dim
    under 128, whose fused blocks would straddle two matrices), two units a rank (whole blocks
    of each matrix); the others' of 6 rows, one unit a rank."""
    if recipe_name == "blockwise":
        return 130, 384 * world, (64, 64, 64)
    return 13, 6 * world, (3, 2, 1)


def _fp8_pair(rank, world, recipe_name, sequence_parallel):
    """A column-parallel fp8 layer feeding a row-parallel one, against the single-device fp8
    GEMMs with the full weights, each within the fp32 rounding of its reordered sums; the
    column layer holds three logical matrices (out_parts: _qkv_sizes), each rank a share of
    each, whose scales along its rows are reduced over the ranks per matrix. Rank 0
    holds the column weight's larger rows and the last rank the row weight's larger columns
    (and the input the larger features), so a scale taken from one shard alone would differ
    from the whole tensor's (and move a result by about an fp8 step, 2^-4 relative: far beyond
    that rounding). The reference row GEMM takes the column output as the ranks computed it,
    and the reference column backward the gradient the ranks' row layer sent: a value that a
    reordered sum moved across an fp8 rounding boundary would otherwise be cast a whole step
    away in one of them."""
    import torch.distributed as dist

    recipe = RECIPES[recipe_name]
    torch.manual_seed(5)
    d_in, d_mid, parts = _qkv_sizes(recipe_name, world)
    batch, seq = 2, 3 * world
    x, g = torch.randn(batch, seq, d_in), torch.randn(batch, seq, d_in) * 1e-3
    x[..., :4] *= 8
    w1, b1 = torch.randn(d_mid, d_in) * 0.1, torch.randn(d_mid)
    w1[: d_mid // world] *= 4
    w2, b2 = torch.randn(d_in, d_mid) * 0.1, torch.randn(d_in)
    w2[:, -(d_mid // world) :] *= 4
    q, k, _ = parts  # k's weights and q's output gradients dwarf the others'
    w1.view(-1, sum(parts), d_in)[:, q : q + k] *= 1024
    w2.view(d_in, -1, sum(parts))[..., :q] *= 1024
    sp = dict(sequence_parallel=sequence_parallel, plan=LinearPlan(recipe))
    col = ColumnParallelLinear(d_in, d_mid, out_parts=parts, **sp)
    row = RowParallelLinear(d_mid, d_in, **sp)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(world)[rank])
        col.bias.copy_(b1.chunk(world)[rank])
        row.weight.copy_(w2.chunk(world, dim=1)[rank])
        row.bias.copy_(b2)
    tokens = (lambda t: t.chunk(world, dim=1)[rank]) if sequence_parallel else (lambda t: t)
    x_in = tokens(x).clone().requires_grad_()
    hidden = col(x_in)
    hidden.retain_grad()
    out = row(hidden)
    out.backward(tokens(g))

    def mine(t, dim=-1):
        return t.chunk(world, dim=dim)[rank]

    def whole(t):  # every rank's shard of t's last dimension
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts, dim=-1)

    def rows(t):  # [tokens, features]
        return t.detach().reshape(-1, t.shape[-1])

    ref_x, ref_w1, ref_b1, ref_w2, ref_b2 = (
        t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)
    )
    ref_hidden = fp8_linear(ref_x, ref_w1, recipe, Split(parts=Parts(parts))) + ref_b1
    ref_hidden.backward(whole(hidden.grad))
    ref_in = whole(hidden).requires_grad_()
    ref_out = fp8_linear(ref_in, ref_w2, recipe, Split()) + ref_b2
    ref_out.backward(g)
    checks = {  # what: (got, want, a, b) for the product a b^T
        "column output": (hidden, mine(ref_hidden), x, mine(w1, 0)),
        "row output": (out, tokens(ref_out), tokens(ref_in), w2),
        "row input gradient": (hidden.grad, mine(ref_in.grad), g, mine(w2).t()),
        "row weight gradient": (row.weight.grad, mine(ref_w2.grad), rows(g).t(), rows(hidden).t()),
        "column weight gradient": (
            col.weight.grad,
            mine(ref_w1.grad, 0),
            rows(hidden.grad).t(),
            rows(x).t(),
        ),
        "column input gradient": (
            x_in.grad,
            tokens(ref_x.grad),
            tokens(whole(hidden.grad)),
            w1.t(),
        ),
    }
    for what, (got, want, a, b) in checks.items():
        _assert_summed_close(got, want, a, b, what)
    assert_close(col.bias.grad, mine(ref_b1.grad), "column bias grad")
    return True


def _fp8_tokens(rank, world, recipe_name):
    """An fp8 GEMM whose tokens are split over the ranks (as over the cp ranks), against the
    single-device one on all the tokens, within the fp32 rounding of their sums: outputs and
    input gradients, and each rank's weight gradient (its partial sum over its tokens) against
    the product of its tokens' share of the whole tensors' fp8 casts. Rank 0's inputs and the
    last rank's output gradients are 2^12 times larger, so a scale over one rank's tokens alone
    would differ from the whole tensor's (rowwise, a power of two: where the whole's scale makes
    the others subnormal)."""
    import torch.distributed as dist

    from megatronish.fp8.quantize import Cast, quantize

    recipe = RECIPES[recipe_name]
    torch.manual_seed(7)
    n = (128 if recipe_name == "blockwise" else 5) * world  # whole 128-token tiles per rank
    x, g, w = torch.randn(n, 13), torch.randn(n, 6) * 1e-3, torch.randn(6, 13) * 0.1
    x[: n // world] *= 2.0**12
    g[-(n // world) :] *= 2.0**12
    mine = slice(rank * n // world, (rank + 1) * n // world)
    x_in, w_in = x[mine].clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_linear(x_in, w_in, recipe, Split(tokens=TokenGroups(dist.group.WORLD)))
    out.backward(g[mine])
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = fp8_linear(ref_x, ref_w, recipe, Split())
    ref.backward(g)
    _assert_summed_close(out, ref[mine], x[mine], w, "output")
    _assert_summed_close(x_in.grad, ref_x.grad[mine], g[mine], w.t(), "input gradient")
    casts = [Cast(g.t(), recipe.grad_output), Cast(x.t(), recipe.input)]
    dy_t, x_t = (q.values() for q in quantize(casts, recipe.power_of_2_scales, Split()))
    want = torch.mm(dy_t[:, mine], x_t[:, mine].t())
    _assert_summed_close(w_in.grad, want, g[mine].t(), x[mine].t(), "weight gradient")
    return True


def rounding_bound(a: torch.Tensor, b: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """How far two fp32 evaluations of a @ b (a [..., k], b [k, m]) that add the products up in
    different orders can differ, elementwise: each is within n u sum |products| of the exact
    value (u = 2^-24, n the terms a sum has: k unless given), so they are within 2 n u
    (|a| @ |b|) of each other."""
    n = a.shape[-1] if n is None else n
    return reordered_sum_bound(n) * (a.double().abs() @ b.double().abs())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str):
    excess = ((actual.double() - expected.double()).abs() - bound).max().item()
    assert excess <= 0, f"{what}: beyond fp32 rounding of a reordered sum by {excess:.2e}"


def _overlap_column(rank, world, weights):
    """The all-gather decomposed under the GEMM (parallel.tp_comm_overlap) against the plain
    sequence-parallel column layer: output, input and weight gradients within the rounding of
    their reordered sums, the same bytes sent, as t - 1 ring hops per all-gather and per
    reduce-scatter. weights 2: llama's gate and up on one gathered input (kept for backward,
    not gathered again)."""
    from megatronish.layers import overlap

    torch.manual_seed(5)
    batch, seq, d_in, d_out = 3, 3 * world, 7, 5 * world
    x = torch.randn(batch, seq, d_in)
    full_w = [torch.randn(d_out, d_in) for _ in range(weights)]
    full_g = [torch.randn(batch, seq, d_out) for _ in range(weights)]
    ws = [w.chunk(world)[rank] for w in full_w]
    grads = [g.chunk(world, dim=-1)[rank] for g in full_g]
    bias = torch.randn(d_out).chunk(world)[rank] if weights == 1 else None
    runs = {}
    for decomposed in (False, True):
        x_local = x.chunk(world, dim=1)[rank].clone().requires_grad_()
        params = [w.clone().requires_grad_() for w in ws]
        b = None if bias is None else bias.clone().requires_grad_()
        with comm.CommCounter() as counter:
            if decomposed:
                outs = overlap.all_gather_linear(
                    x_local, params, [b] * weights, None, keep_gathered=weights > 1
                )
            elif weights == 1:  # the layer gathers x again in backward
                outs = [column_parallel_linear(x_local, params[0], b, None, True)]
            else:  # gate and up keep the gathered x
                full = mappings.gather_from_sequence_parallel_region(x_local)
                outs = [F.linear(full, p) for p in params]
            torch.autograd.backward(outs, grads)
        runs[decomposed] = (outs, x_local.grad, [p.grad for p in params], b, counter)
    (want, want_dx, want_dw, want_b, off), (outs, dx, dw, b, on) = runs[False], runs[True]
    ones = torch.ones(batch, seq, 1)
    for out, expected, w in zip(outs, want, ws):  # the bias as one more product, 1 x b
        with_bias = w if bias is None else torch.cat([w, bias[:, None]], dim=1)
        inputs = x if bias is None else torch.cat([x, ones], dim=-1)
        assert_within(out, expected, rounding_bound(inputs, with_bias.t()), "output")
    # dx sums weights x d_out products: t ranks' partials of this rank's sequence chunk
    dx_bound = sum(rounding_bound(g, w, weights * d_out) for g, w in zip(full_g, full_w))
    assert_within(dx, want_dx, dx_bound.chunk(world, dim=1)[rank], "input grad")
    for got, expected, g in zip(dw, want_dw, grads):
        bound = rounding_bound(g.flatten(0, 1).t(), x.flatten(0, 1))
        assert_within(got, expected, bound, "weight grad")
    if bias is not None:
        assert torch.equal(b.grad, want_b.grad)
    hops = (3 if weights == 1 else 2) * (world - 1)  # gathers of x and a reduce-scatter
    assert on.total_sent == pytest.approx(off.total_sent, rel=FP64_REORDER)
    assert on.calls["tp_ring"] == hops
    assert on.calls["all_gather"] == on.calls["reduce_scatter"] == 0
    return True


def _overlap_row(rank, world, sequence_parallel):
    """The row layer with its reduction decomposed under the GEMM against the plain one: with
    sequence parallelism a ring reduce-scatter forward and a ring all-gather backward, without
    it t chunked all-reduces forward; within the rounding of the reordered sums, the same
    bytes sent."""
    torch.manual_seed(6)
    batch, seq, d_in, d_out = 2, 3 * world, 3 * world, 11
    full_x, full_w = torch.randn(batch, seq, d_in), torch.randn(d_out, d_in)
    full_grad = torch.randn(batch, seq, d_out)
    x, w = full_x.chunk(world, dim=-1)[rank], full_w.chunk(world, dim=1)[rank]
    grad_out = full_grad.chunk(world, dim=1)[rank] if sequence_parallel else full_grad
    runs = {}
    for decomposed in (False, True):
        plan = LinearPlan(overlap=decomposed)
        layer = RowParallelLinear(d_in, d_out, sequence_parallel=sequence_parallel, plan=plan)
        with torch.no_grad():
            layer.weight.copy_(w)
        x_in = x.clone().requires_grad_()
        with comm.CommCounter() as counter:
            out = layer(x_in)
            out.backward(grad_out)
        runs[decomposed] = (out.detach(), x_in.grad, layer.weight.grad, layer.bias.grad, counter)
    (want, want_dx, want_dw, want_db, off), (out, dx, dw, db, on) = runs[False], runs[True]
    bound = rounding_bound(full_x, full_w.t())  # t ranks' partials of d_in / t products
    if sequence_parallel:
        bound = bound.chunk(world, dim=1)[rank]
    assert_within(out, want, bound, "output")
    assert_within(dx, want_dx, rounding_bound(full_grad, w), "input grad")
    dw_bound = rounding_bound(full_grad.flatten(0, 1).t(), x.flatten(0, 1))
    assert_within(dw, want_dw, dw_bound, "weight grad")
    assert torch.equal(db, want_db)
    assert on.total_sent == pytest.approx(off.total_sent, rel=FP64_REORDER)
    if sequence_parallel:
        assert on.calls["tp_ring"] == 2 * (world - 1) and on.calls["reduce_scatter"] == 0
    else:
        assert on.calls["all_reduce"] == world and off.calls["all_reduce"] == 1
    return True


def _overlap_fp8(rank, world, recipe_name, sequence_parallel):
    """The decomposed fp8 GEMMs (parallel.tp_comm_overlap with train.precision fp8) against the
    fp8 layers without the decomposition, each layer on the same inputs (the column layer of
    three logical matrices: _qkv_sizes): outputs and input
    gradients within the fp32 rounding of their reordered sums (a scale other than the plain
    layer's moves an fp8 value by up to 1/16, far beyond it), weight gradients bit for bit (the
    same casts of the same numbers, one GEMM). With sequence parallelism the counted tp_ring
    bytes: a column layer (bias, its input gathered again in backward) sends its input's fp8
    cast forward and the tensorwise payload or the input itself backward; llama's gate and up
    (the gathered input kept) the fp8 cast (tensorwise) or the input itself forward only; the
    reduce-scatters of dx and the row layer's rings in their own precision."""
    from megatronish.layers import overlap
    from megatronish.layers.linear import local_linear

    recipe = RECIPES[recipe_name]
    torch.manual_seed(11)
    d_in, d_mid, sizes = _qkv_sizes(recipe_name, world)
    batch, seq = 2, 2 * world
    x = torch.randn(batch, seq, d_in)
    x[..., :3] *= 8
    full_w = [torch.randn(d_mid, d_in) * 0.1 for _ in range(3)]  # column, gate, up
    full_w[0][: d_mid // world] *= 4  # a scale of rank 0's shard alone would differ
    bias = torch.randn(d_mid)
    full_g = [torch.randn(batch, seq, d_mid) * 1e-3 for _ in range(3)]
    full_g[1][:, : seq // world] *= 16  # rank 0's sequence chunk holds the larger gradients
    parts, (q, k, _) = Parts(sizes), sizes  # the column layer's k weights and q gradients
    full_w[0].view(-1, sum(sizes), d_in)[:, q : q + k] *= 1024
    full_g[0].view(batch, seq, -1, sum(sizes))[..., :q] *= 1024
    ws = [w.chunk(world)[rank] for w in full_w]
    grads = [g.chunk(world, dim=-1)[rank] for g in full_g]
    row_x = torch.randn(batch, seq, d_mid)
    row_x[:, -(seq // world) :] *= 8  # the last rank's chunk is the larger
    row_w = torch.randn(d_in, d_mid) * 0.1
    row_g = torch.randn(batch, seq, d_in) * 1e-3
    row_g[:, : seq // world] *= 16
    tokens = (lambda t: t.chunk(world, dim=1)[rank]) if sequence_parallel else (lambda t: t)
    runs = {}
    for decomposed in (False, True):
        x_in = tokens(x).clone().requires_grad_()
        params = [w.clone().requires_grad_() for w in ws]
        b = bias.chunk(world)[rank].clone().requires_grad_()
        plan = LinearPlan(recipe, overlap=decomposed)
        sp = dict(sequence_parallel=sequence_parallel, plan=plan)
        row = RowParallelLinear(d_mid, d_in, bias=False, **sp)
        with torch.no_grad():
            row.weight.copy_(row_w.chunk(world, dim=1)[rank])
        hidden = row_x.chunk(world, dim=-1)[rank].clone().requires_grad_()
        with comm.CommCounter() as counter:
            col = column_parallel_linear(
                x_in,
                params[0],
                b,
                None,
                sequence_parallel,
                plan,
                out_parts=parts,
            )
            if decomposed and sequence_parallel:
                gate_up = overlap.all_gather_linear(
                    x_in, params[1:], [None, None], None, keep_gathered=True, recipe=recipe
                )
            else:
                full = (
                    mappings.gather_from_sequence_parallel_region(x_in)
                    if sequence_parallel
                    else mappings.copy_to_tensor_parallel_region(x_in)
                )
                gate_up = [
                    local_linear(full, p, None, recipe, Split(None, "out")) for p in params[1:]
                ]
            out = row(hidden)
            torch.autograd.backward([col, *gate_up, out], [*grads, tokens(row_g)])
        runs[decomposed] = ([col, *gate_up, out], x_in.grad, hidden.grad, params, b, row, counter)
    plain, mine = runs[False], runs[True]
    for got, want, w in zip(mine[0][:3], plain[0][:3], ws):
        _assert_summed_close(got, want, x, w, "column output")
    _assert_summed_close(mine[0][3], plain[0][3], tokens(row_x), row_w, "row output")
    dx_a, dx_b = torch.cat(full_g, dim=-1), torch.cat(full_w, dim=0).t()
    _assert_summed_close(mine[1], plain[1], tokens(dx_a), dx_b, "column input gradient")
    _assert_summed_close(mine[2], plain[2], row_g, row_w.chunk(world, dim=1)[rank].t(), "row dx")
    for i, (got, want) in enumerate(zip(mine[3], plain[3])):
        diff = (got.grad - want.grad).abs().max()
        assert torch.equal(got.grad, want.grad), f"column weight gradient {i}: {diff:.3e}"
    assert torch.equal(mine[4].grad, plain[4].grad), "column bias gradient"
    assert torch.equal(mine[5].weight.grad, plain[5].weight.grad), "row weight gradient"
    on, chunk = mine[6], batch * seq // world
    if not sequence_parallel:
        assert on.calls["tp_ring"] == 0 and on.calls["all_reduce"] > plain[6].calls["all_reduce"]
        return True
    scales = {"tensorwise": 0, "rowwise": 4, "blockwise": 4 * -(-d_in // 128)}[recipe_name]
    fp8_chunk = chunk * (d_in + scales)  # a chunk's fp8 cast: payload and float32 scales
    hp = x.element_size()
    again = chunk * d_in * (1 if recipe_name == "tensorwise" else hp)  # gathered for dW
    # gate and up keep what they gathered: the fp8 cast (tensorwise), else x itself
    gate_up = fp8_chunk if recipe_name == "tensorwise" else chunk * d_in * hp
    ring = (world - 1) * (
        fp8_chunk  # column forward
        + again  # column backward
        + gate_up
        + 2 * chunk * d_in * hp  # the column layers' dx reduce-scatters
        + 2 * chunk * d_in * hp  # the row layer's output forward, its gradient backward
    )
    assert on.calls["tp_ring"] == 7 * (world - 1)
    assert on.payload_bytes["tp_ring"] == ring
    assert on.calls["all_gather"] == on.calls["reduce_scatter"] == 0
    return True


CHECKS = {
    "column": lambda r, w: _column(r, w, False, False),
    "column_gather_output": lambda r, w: _column(r, w, True, False),
    "row": lambda r, w: _row(r, w, True, False),
    "row_scatter_input": lambda r, w: _row(r, w, False, False),
    "column_sequence_parallel": lambda r, w: _column(r, w, False, True),
    "row_sequence_parallel": lambda r, w: _row(r, w, True, True),
    "embedding": _embedding,
    "cross_entropy": _cross_entropy,
    "mapping_bytes": _mappings_bytes,
    **{
        f"fp8_{recipe}{'_sequence_parallel' * sp}": functools.partial(
            _fp8_pair, recipe_name=recipe, sequence_parallel=sp
        )
        for recipe in RECIPES
        for sp in (False, True)
    },
    **{
        f"fp8_{recipe}_tokens_split": functools.partial(_fp8_tokens, recipe_name=recipe)
        for recipe in RECIPES
    },
    "column_overlap": lambda r, w: _overlap_column(r, w, 1),
    "gate_up_overlap": lambda r, w: _overlap_column(r, w, 2),
    "row_overlap_sequence_parallel": lambda r, w: _overlap_row(r, w, True),
    "row_overlap_all_reduce": lambda r, w: _overlap_row(r, w, False),
    **{
        f"overlap_fp8_{recipe}{'_sequence_parallel' * sp}": functools.partial(
            _overlap_fp8, recipe_name=recipe, sequence_parallel=sp
        )
        for recipe in RECIPES
        for sp in (False, True)
    },
}
"""Each check by name: run on every rank of a world (2 or 4), it raises where the layers
differ. A test item names its check by its `check` parameter and its world by `world`."""

WORLDS = [2, 4]


def _run_checks(rank: int, world: int, names: list[str]) -> dict[str, tuple | None]:
    """The named checks on this rank: None for each that passed, else (its exception, the
    traceback text)."""
    import traceback

    results = {}
    for name in names:
        try:
            CHECKS[name](rank, world)
            results[name] = None
        except Exception as error:  # noqa: BLE001 - raised again by the check's test item
            results[name] = (error, traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def layer_check(request):
    """check(world, name): raises the named check's own exception from the first rank where it
    failed (every failing rank's traceback as a note). The checks of every selected item of this
    module run once per world size, on one start of its ranks, when the first of them runs."""
    selected: dict[int, list[str]] = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "check" in params:
            selected.setdefault(params["world"], []).append(params["check"])
    results: dict[int, list[dict]] = {}

    def check(world: int, name: str) -> None:
        if world not in results:
            names = list(dict.fromkeys(selected.get(world, [name])))
            results[world] = run_on_ranks(_run_checks, world, names, timeout=180)
        failed = [(r, res[name]) for r, res in enumerate(results[world]) if res[name]]
        if failed:
            error = failed[0][1][0]
            for rank, (_, text) in failed:
                error.add_note(f"rank {rank} of {world}:\n{text}")
            raise error

    return check


def _checks(*names: str):
    """Parametrizes a test over the named checks and the world sizes (each one item)."""

    def mark(test):
        test = pytest.mark.parametrize("check", list(names))(test)
        return pytest.mark.parametrize("world", WORLDS)(test)

    return mark


@_checks("column")
def test_column_parallel_linear_matches_full_linear(world, check, layer_check):
    layer_check(world, check)


@_checks("column_gather_output")
def test_column_parallel_linear_gather_output_matches_full_linear(world, check, layer_check):
    layer_check(world, check)


@_checks("row")
def test_row_parallel_linear_matches_full_linear(world, check, layer_check):
    layer_check(world, check)


@_checks("row_scatter_input")
def test_row_parallel_linear_with_unsplit_input_matches_full_linear(world, check, layer_check):
    layer_check(world, check)


@_checks("column_sequence_parallel", "row_sequence_parallel")
def test_sequence_parallel_linears_match_full_linear(world, check, layer_check):
    layer_check(world, check)


@_checks("embedding")
def test_vocab_parallel_embedding_matches_full_embedding(world, check, layer_check):
    layer_check(world, check)


@_checks("cross_entropy")
def test_vocab_parallel_cross_entropy_matches_full_and_ignores_minus_100(world, check, layer_check):
    layer_check(world, check)


@_checks("mapping_bytes")
def test_communication_ops_all_reduce_once_in_the_right_direction(world, check, layer_check):
    layer_check(world, check)


@_checks(*(f"fp8_{r}{sp}" for r in RECIPES for sp in ("", "_sequence_parallel")))
def test_fp8_column_and_row_parallel_layers_equal_the_single_device_fp8_gemms(
    world, check, layer_check
):
    layer_check(world, check)


@_checks(*(f"fp8_{r}_tokens_split" for r in RECIPES))
def test_fp8_gemms_with_the_tokens_split_over_ranks_equal_the_single_device_ones(
    world, check, layer_check
):
    layer_check(world, check)


def test_layers_without_process_group_are_plain_ops():
    torch.manual_seed(4)
    layer = ColumnParallelLinear(5, 3)
    x = torch.randn(2, 5)
    assert_close(layer(x), F.linear(x, layer.weight, layer.bias), "column")
    row = RowParallelLinear(5, 3)
    assert_close(row(x), F.linear(x, row.weight, row.bias), "row")
    logits, target = torch.randn(6, 10), torch.randint(0, 10, (6,))
    assert_close(
        vocab_parallel_cross_entropy(logits, target),
        F.cross_entropy(logits, target, reduction="none"),
        "cross entropy",
    )


@_checks(
    "column_overlap", "gate_up_overlap", "row_overlap_sequence_parallel", "row_overlap_all_reduce"
)
def test_decomposed_tp_collectives_match_the_plain_layers_to_fp32_rounding_and_send_the_same_bytes(
    world, check, layer_check
):
    layer_check(world, check)


@_checks(*(f"overlap_fp8_{r}{sp}" for r in RECIPES for sp in ("", "_sequence_parallel")))
def test_decomposed_fp8_gemms_equal_the_plain_fp8_layers_to_fp32_rounding(
    world, check, layer_check
):
    layer_check(world, check)
