"""The Triton attention forward's report of each query's largest score (QK-clip's record,
row_max) against float64 torch under Triton's interpreter (tests/kernel_env.py): masked pairs
never count (causal, a sliding window, document masks), grouped-query heads read their kv
head, and the score is q.k times the scale after any soft-cap; through megatronish.ops and a
model's attention layer the heads' maxima are the torch path's."""

from __future__ import annotations

import pytest
import torch

from megatronish import ops
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.ops import reference
from tests.kernel_env import kernels
from tests.tolerances import EXACT, KERNEL_ABS, KERNEL_REL

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQ = 40  # over the interpreter's forward tile (32 x 16)


def _tensor(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _row_max64(q, k, visible, scale: float, softcap: float | None) -> torch.Tensor:
    """[b, n, s]: each query's largest visible score, in float64."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~visible, float("-inf")).amax(dim=-1)


# (window, documents, scale, softcap, sinks)
CASES = {
    "window documents": (7, True, None, None, False),
    "scale softcap sinks": (None, False, 0.4, 2.0, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_forward_kernel_reports_each_querys_largest_visible_score(case):
    window, with_documents, scale, softcap, with_sinks = CASES[case]
    q, k, v = (
        _tensor(1, 4, SEQ, 16, seed=1),
        _tensor(1, 2, SEQ, 16, seed=2),
        _tensor(1, 2, SEQ, 16, seed=3),
    )
    k[:, :, -1] *= 50  # the last key's scores dwarf the rest: only the last query sees it
    segments = None
    if with_documents:
        segments = torch.zeros(1, SEQ, dtype=torch.int32)
        segments[0, 13:], segments[0, 30:] = 1, 2
    visible = reference.attention_mask(SEQ, q.device, True, segments, window)
    want = _row_max64(q, k, visible, 0.25 if scale is None else scale, softcap)
    sinks = _tensor(4, seed=4).float().to(DEVICE) if with_sinks else None
    rows = torch.empty(1, 4, SEQ, device=DEVICE)
    inputs = [x.float().to(DEVICE) for x in (q, k, v)]
    segments = None if segments is None else segments.to(DEVICE)
    options = dict(scale=scale, softcap=softcap, sinks=sinks)
    out = kernels.attention(*inputs, True, segments, window, **options, row_max=rows)
    torch.testing.assert_close(rows.double().cpu(), want, atol=KERNEL_ABS, rtol=KERNEL_REL)
    plain = kernels.attention(*inputs, True, segments, window, **options)
    torch.testing.assert_close(out, plain, atol=EXACT, rtol=EXACT)  # the output as without it
    with pytest.raises(ValueError, match="row_max"):
        ops.attention(*inputs, True, "torch", segments, window, **options, row_max=rows)


def test_a_layers_head_maxima_from_the_kernel_are_the_torch_paths():
    sets = ["model.arch=llama", "model.n_layer=1", "model.n_head=4", "model.n_kv_head=2"]
    sets += ["model.d_model=64", "model.vocab_size=61", "model.max_seq_len=16"]  # heads of 16
    sets += ["train.seq_len=16", "optim.name=muon", "optim.muon.qk_clip_tau=1"]
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    maxima = []
    for backend in ("torch", "triton"):
        cfg = load_config(None, [*sets, f"kernels.backend={backend}"])
        torch.manual_seed(0)
        model = GPT(cfg, derive(cfg, 1), ParallelState.single()).to(DEVICE).train()
        model(tokens.to(DEVICE))
        maxima.append(model.blocks["0"].attn.logit_max.take().cpu())
    torch.testing.assert_close(maxima[1], maxima[0], atol=KERNEL_ABS, rtol=KERNEL_REL)
