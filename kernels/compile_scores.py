"""The attention launches with score options for compile_check: attention sinks at GPT-OSS's
head dim (64) and logit soft-capping at Gemma 3 27B's (128), forward and backward, causal, at
one tensor-parallel rank's shapes of the published models, on meta tensors, built by the
launchers' own functions (compile_check.attention_pass): over the whole sequence, under the
model's sliding window, and under the window with document masks. Sinks change the forward
kernel only (the backward reads them from the lse); the soft-cap changes all three."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._utils import Launch
from .compile_check import ModelShapes, attention_pass


@dataclass(frozen=True)
class ScoreShapes:
    """One rank's attention in a model whose scores take sinks or a soft-cap."""

    model: ModelShapes
    window: int  # the sliding layers' window
    sinks: bool
    softcap: float | None


# gpt-oss-20b (transformers' GptOssConfig): 64 query heads of 64 on 8 kv heads, sinks on every
# layer, a window of 128 on every other; trained at s 4096 here.
GPT_OSS_20B = ScoreShapes(
    ModelShapes(
        name="gpt-oss-20b tp1", family="llama", batch=1, seq_len=4096, d_model=2880,
        head_dim=64, n_head=64, n_kv_head=8, d_ff=2880, vocab=201088, norm_rows=4096,
    ),
    window=128, sinks=True, softcap=None,
)  # fmt: skip
# gemma-3-27b text (transformers' Gemma3TextConfig): 32 query heads of 128 on 16 kv heads, a
# window of 1024 on five layers of six; its scores soft-capped at Gemma 2's 50.
GEMMA3_27B = ScoreShapes(
    ModelShapes(
        name="gemma-3-27b tp1", family="llama", batch=1, seq_len=4096, d_model=5376,
        head_dim=128, n_head=32, n_kv_head=16, d_ff=21504, vocab=262208, norm_rows=4096,
    ),
    window=1024, sinks=False, softcap=50.0,
)  # fmt: skip
SCORE_SHAPES = (GPT_OSS_20B, GEMMA3_27B)


def score_launches(m: ScoreShapes, dtype: torch.dtype, arch: int) -> list[tuple[Launch, str]]:
    """The forward's and backward's launches of m in dtype for GPU arch `arch`, each with where
    it comes from ("sinks" or "softcap", with " window" and " documents")."""
    tag = "sinks" if m.sinks else "softcap"
    launches = []
    for window, documents in ((None, False), ((m.window, 0), False), ((m.window, 0), True)):
        where = tag + (" window" if window else "") + (" documents" if documents else "")
        model = m.model
        for launch in attention_pass(
            model, dtype, arch, model.seq_len, True, False, documents, window, m.softcap, m.sinks
        ):
            launches.append((launch, where))
    return launches
