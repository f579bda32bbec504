"""GPT-OSS's blocks through the decode cache: sinks (made large enough to matter), a sliding
window of 5 in the first block shorter than the 7-token prompt, YaRN, and biased experts behind
the clamped SwiGLU give the logits of the full forward one token at a time."""

from __future__ import annotations

import torch

from megatronish.checkpoint.reader import Checkpoint
from megatronish.distributed.layout import ParallelState
from megatronish.inference.model import build_model
from tests.checkpoints import VOCAB, save_single, tiny_cfg, tokens
from tests.inference.test_generate import _cached_and_full
from tests.tolerances import BEYOND_ROUNDING, EXACT, FP32_DECODE_ABS

GPT_OSS = [
    "model.head_dim=16",
    "model.n_kv_head=2",
    "model.sliding_window=5",
    "model.layer_types=[sliding_attention, full_attention]",
    "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 16}",
    "model.swiglu_limit=0.5",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
]


def test_cached_decoding_with_sinks_gives_the_logits_of_the_full_forward(tmp_path):
    path, _ = save_single(tmp_path / "gpt_oss", tiny_cfg("gpt_oss", *GPT_OSS))
    model = build_model(Checkpoint(path), ParallelState.single())
    sinks = [block.attn.sinks for block in model.blocks.values()]
    with torch.no_grad():
        for sink in sinks:  # logits of order 1, as the scores: the sinks take a real share
            sink.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    sequence = tokens(2, 24, seed=3)
    cached, full, cache = _cached_and_full(model, sequence)
    assert len(cache) == 2 and cache[0][0].shape[2] == 24
    torch.testing.assert_close(cached, full, rtol=EXACT, atol=FP32_DECODE_ABS)
    for block in model.blocks.values():  # the same weights without sinks
        block.attn.sinks = None
    with torch.no_grad():
        sinkless = model(sequence)
    assert (sinkless[..., :VOCAB] - full[..., :VOCAB]).abs().max() > BEYOND_ROUNDING
