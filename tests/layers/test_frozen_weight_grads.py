"""A weight that needs no gradient (LoRA's frozen base) gets none from the linear layers' own
backward passes: their weight-gradient GEMM does not run (counted), and the input gradient is
bitwise the one the same weight with a gradient gives (the dX GEMM is untouched). In process,
at a group of one: the plain column layer with and without sequence parallelism, the
chunked all-reduce schedule of parallel.tp_comm_overlap, and the fp8 GEMM (the ring schedules
need two ranks: tests/hf/test_lora_curve.py counts them there)."""

from __future__ import annotations

import pytest
import torch

from megatronish.distributed import comm
from megatronish.fp8 import RECIPES, Split, TokenGroups, gemm
from megatronish.fp8.gemm import fp8_linear
from megatronish.layers.formats import HighPrecision
from megatronish.layers.linear import _ColumnLinear
from megatronish.layers.overlap import _LinearAllReduce


class CountingFormat(HighPrecision):
    """The autocast precision, counting its weight-gradient GEMMs."""

    def __init__(self) -> None:
        self.weight_gemms = 0

    def grad_weight(self, grad_rows, x_rows, weight, split, state):
        self.weight_gemms += 1
        return super().grad_weight(grad_rows, x_rows, weight, split, state)


def _column(sequence_parallel: bool):
    def run(x, weight, fmt):
        split = Split(None, "out", TokenGroups())
        return _ColumnLinear.apply(x, weight, None, None, sequence_parallel, fmt, split)

    return run


def _all_reduce(x, weight, fmt):
    return _LinearAllReduce.apply(x, weight, None, fmt, Split(None, "in", TokenGroups()))


def _backward(schedule, frozen: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(dx, the weight's gradient, weight-gradient GEMMs) of one backward of `schedule`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 12, generator=generator, requires_grad=True)
    weight = torch.randn(10, 12, generator=generator).requires_grad_(not frozen)
    fmt = CountingFormat()
    schedule(x, weight, fmt).square().sum().backward()
    return x.grad, weight.grad, fmt.weight_gemms


@pytest.mark.parametrize(
    "schedule",
    [_column(False), _column(True), _all_reduce],
    ids=["column", "column-sp", "chunked-all-reduce"],
)
def test_a_frozen_weight_gets_no_weight_gradient_gemm_and_the_same_input_gradient(
    schedule, monkeypatch
):
    done = type("Done", (), {"wait": lambda self: None})()  # a group of one reduces nothing
    monkeypatch.setattr(comm, "all_reduce", lambda *args, **kwargs: done)
    dx, grad, gemms = _backward(schedule, frozen=False)
    frozen_dx, frozen_grad, frozen_gemms = _backward(schedule, frozen=True)
    assert gemms >= 1 and grad is not None
    assert frozen_gemms == 0 and frozen_grad is None
    assert torch.equal(frozen_dx, dx)


def test_a_frozen_weight_gets_no_fp8_weight_gradient_gemm(monkeypatch):
    calls = []
    original = gemm.grad_weight_gemm
    monkeypatch.setattr(gemm, "grad_weight_gemm", lambda *a: calls.append(1) or original(*a))
    recipe, split = RECIPES["tensorwise"], Split(None, "out", TokenGroups())

    def fp8(x, weight, fmt):
        return fp8_linear(x, weight, recipe, split)

    dx, grad, _ = _backward(fp8, frozen=False)
    assert len(calls) == 1 and grad is not None
    frozen_dx, frozen_grad, _ = _backward(fp8, frozen=True)
    assert len(calls) == 1 and frozen_grad is None
    assert torch.equal(frozen_dx, dx)
