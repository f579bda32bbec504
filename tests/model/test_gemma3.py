"""Gemma 3's components in one process (model.arch gemma3): four norms a block (before and after
each sublayer) scaling by 1 + their zero-initialized weights, embeddings scaled by sqrt(d_model)
cast to their dtype, and a cached decode that equals the full forward with both soft-caps, the
local blocks' window and RoPE base and the global block's scaled RoPE (transformers' logits:
tests/hf/test_hf_gemma3.py; layouts: tests/model/test_gemma3_layouts.py)."""

from __future__ import annotations

import torch

from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.inference.decode import decode_step
from megatronish.model import GPT
from megatronish.model.norm import Norm
from tests.model.test_gated_attention import randomize
from tests.tolerances import EXACT, FP32_REORDER

SEQ = 12
VOCAB = 61
GEMMA3 = [
    "model.arch=gemma3",
    "model.n_layer=3",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.d_model=40",
    "model.head_dim=16",
    "model.query_pre_attn_scalar=24",
    "model.sliding_window=5",
    "model.layer_types=[sliding_attention, full_attention, sliding_attention]",
    "model.rope_scaling={type: linear, factor: 8}",
    "model.attn_logit_softcapping=2",
    "model.final_logit_softcapping=3",
    f"model.vocab_size={VOCAB}",
    "model.max_seq_len=16",
    f"train.seq_len={SEQ}",
]


def gemma3_model() -> GPT:
    cfg = load_config(None, GEMMA3)
    torch.manual_seed(0)
    return GPT(cfg, derive(cfg, 1), ParallelState.single())


def test_a_gemma3_block_has_four_norms_and_every_norm_scales_by_one_plus_a_zero_weight():
    model = gemma3_model()
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    assert len(norms) == 3 * (4 + 2) + 1  # four per block, q and k's, the final one
    assert all(m.offset == 1.0 and not m.weight.any() for m in norms)
    block = model.blocks["0"]
    assert block.attn_out_norm is not None and block.mlp_out_norm is not None


def test_gemma3_embeddings_are_scaled_by_sqrt_d_model_in_their_dtype():
    model = gemma3_model()
    tokens = torch.arange(VOCAB)[None]
    with torch.no_grad():
        table = model.tok_emb.weight[:VOCAB][None]
        torch.testing.assert_close(model.embed(tokens), table * 40**0.5, rtol=EXACT, atol=EXACT)
        bf16 = model.scaled(table.bfloat16())
    assert torch.equal(bf16, table.bfloat16() * torch.tensor(40**0.5, dtype=torch.bfloat16))


def test_gemma3_cached_decode_equals_the_full_forward():
    model = gemma3_model()
    randomize(model, 6)
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens)
        cache: list = []
        steps = [decode_step(model, tokens[:, :7], cache, 0)]
        steps += [decode_step(model, tokens[:, i : i + 1], cache, i) for i in range(7, SEQ)]
    got = torch.cat(steps, dim=1)[..., :VOCAB]
    assert full[..., :VOCAB].abs().max() < 3  # the final soft-cap bounds the logits
    torch.testing.assert_close(got, full[..., :VOCAB], rtol=FP32_REORDER, atol=FP32_REORDER)
