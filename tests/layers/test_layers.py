"""Each tensor-parallel layer equals the single-device computation with the full weights,
forward and every gradient, on 2 and 4 gloo ranks at odd sizes."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from megatronish.distributed import comm
from megatronish.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mappings,
    vocab_parallel_cross_entropy,
)
from tests.ranks import run_on_ranks

RTOL = 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item() + 1e-12
    assert err / scale < RTOL, f"{what}: relative error {err / scale:.2e}"


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
}


def _all_checks(rank, world):
    """Every check on this rank (one process start per world size keeps the suite fast)."""
    import traceback

    results = {}
    for name, check in CHECKS.items():
        try:
            check(rank, world)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per check by the tests below
            results[name] = traceback.format_exc()
    return results


@functools.cache
def results_on(world: int) -> dict[str, str | None]:
    per_rank = run_on_ranks(_all_checks, world, timeout=180)
    merged = {}
    for name in CHECKS:
        errors = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name]]
        merged[name] = "\n".join(errors) or None
    return merged


def check(world: int, name: str) -> None:
    error = results_on(world)[name]
    assert error is None, error


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_linear_matches_full_linear(world):
    check(world, "column")


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_linear_gather_output_matches_full_linear(world):
    check(world, "column_gather_output")


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_linear_matches_full_linear(world):
    check(world, "row")


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_linear_with_unsplit_input_matches_full_linear(world):
    check(world, "row_scatter_input")


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_linears_match_full_linear(world):
    check(world, "column_sequence_parallel")
    check(world, "row_sequence_parallel")


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_matches_full_embedding(world):
    check(world, "embedding")


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_matches_full_and_ignores_minus_100(world):
    check(world, "cross_entropy")


@pytest.mark.parametrize("world", [2, 4])
def test_communication_ops_all_reduce_once_in_the_right_direction(world):
    check(world, "mapping_bytes")


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
