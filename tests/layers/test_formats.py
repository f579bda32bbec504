"""The numeric formats (megatronish.layers.formats, fp8_format): the bytes each states for the
accounting are those its decomposed schedules put on the ring, and every format answers what
the schedules and the accounting ask of one."""

from __future__ import annotations

import pytest
import torch

from megatronish.fp8 import RECIPES, Split
from megatronish.layers.formats import HIGH_PRECISION, HighPrecision
from megatronish.layers.fp8_format import Fp8, pack
from megatronish.layers.plan import numeric_format

FORMATS = [HIGH_PRECISION, *(Fp8(recipe) for recipe in RECIPES.values())]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("fmt", FORMATS, ids=["high_precision", *RECIPES])
@pytest.mark.parametrize("keep_gathered", [False, True])
def test_wire_and_again_bytes_are_what_the_ring_sends(fmt, keep_gathered):
    batch, chunk, k = 2, 3, 130  # k: one full 128-wide tile and a narrower one
    x = torch.randn(batch, chunk, k, dtype=torch.bfloat16)
    x_op, _, _ = fmt.operands(x, [torch.randn(4, k)], Split(), gathered=False)
    sent = fmt.send(x_op, x, keep_gathered)
    tokens, width = batch * chunk, x.element_size()
    assert fmt.wire_bytes(tokens, k, width, keep_gathered) == _nbytes(sent)
    assert fmt.again_bytes(tokens, k, width) == _nbytes(fmt.again(sent, x))


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_tensorwise_cast_sends_no_scales_and_a_finer_one_its_layouts(name):
    batch, chunk, k = 1, 4, 130
    x = torch.randn(batch, chunk, k)
    fmt = numeric_format(RECIPES[name])
    qx, _, _ = fmt.operands(x, [torch.randn(4, k)], Split(), gathered=False)
    scales = {"tensorwise": 0, "rowwise": 1, "blockwise": 2}[name]  # a token's float32 scales
    assert pack(qx, batch).shape == (batch, chunk, k + 4 * scales)


def test_every_format_answers_what_the_schedules_and_the_accounting_ask():
    def methods(cls) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert methods(Fp8) == methods(HighPrecision)
    assert numeric_format(None) is HIGH_PRECISION
