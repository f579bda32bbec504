"""Qwen and Mistral attention against transformers (fp32, eager): a tiny random
Qwen2ForCausalLM (biases on q, k and v) loaded into our llama with model.qkv_bias, and a
Qwen3ForCausalLM (per-head norms of q and k, head_dim apart from hidden_size / heads) into ours
with model.qk_norm, give the same logits; so do a MistralForCausalLM with a sliding window
shorter than the sequence (model.sliding_window) and a Qwen2ForCausalLM whose first layer
attends fully and the second through the window (model.full_attention_layers). The names are
mapped here; importing these families is not covered."""

from __future__ import annotations

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.hf.family import merge_qkv
from megatronish.hf.llama import from_hf
from megatronish.model import GPT

transformers = pytest.importorskip("transformers")

VOCAB, N_HEAD, N_KV_HEAD, HEAD_DIM, D_MODEL = 67, 4, 2, 12, 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=D_MODEL,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=N_HEAD,
    num_key_value_heads=N_KV_HEAD,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


def ours_of(hf_model, *sets: str) -> GPT:
    """Our tp-1 model with hf_model's weights (its biases on q, k and v merged as the weights,
    its per-head q and k norms renamed)."""
    cfg = load_config(
        None,
        [
            "model.arch=llama",
            "model.n_layer=2",
            f"model.n_head={N_HEAD}",
            f"model.n_kv_head={N_KV_HEAD}",
            f"model.d_model={D_MODEL}",
            f"model.head_dim={HEAD_DIM}",
            "model.d_ff=48",
            f"model.vocab_size={VOCAB}",
            "model.max_seq_len=32",
            "model.norm_eps=1e-6",
            "train.seq_len=16",
            *sets,
        ],
    )
    model = GPT(cfg, derive(cfg, 1), ParallelState.single()).eval()
    hf = {k: v.clone() for k, v in hf_model.state_dict().items()}
    biases = {}  # and the q and k norms
    for i in range(2):
        parts = [hf.pop(f"model.layers.{i}.self_attn.{p}_proj.bias", None) for p in "qkv"]
        if parts[0] is not None:
            biases[f"blocks.{i}.attn.qkv.bias"] = merge_qkv(*parts, N_HEAD, N_KV_HEAD, HEAD_DIM)
        for part in "qk":
            norm = hf.pop(f"model.layers.{i}.self_attn.{part}_norm.weight", None)
            if norm is not None:
                biases[f"blocks.{i}.attn.{part}_norm.weight"] = norm
    head = hf.pop("lm_head.weight")
    ours = {**from_hf(hf, dict(n_layer=2, n_head=N_HEAD, n_kv_head=N_KV_HEAD)), **biases}
    ours["lm_head.weight"] = head
    assert not hf, f"every Hugging Face tensor mapped: {sorted(hf)}"
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(ours), "every parameter of ours has a Hugging Face tensor"
    with torch.no_grad():
        for name, tensor in ours.items():
            params[name][: tensor.shape[0]].copy_(tensor)
    return model


@pytest.mark.parametrize("family, key", [("Qwen2", "model.qkv_bias"), ("Qwen3", "model.qk_norm")])
def test_qwen_attention_equals_transformers_logits(family, key):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**COMMON, head_dim=HEAD_DIM)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # random biases and norm weights (they init to 0 and 1): each shows
        for name, p in hf_model.named_parameters():
            if name.endswith(("proj.bias", "q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.5)
    model = ours_of(hf_model, f"{key}=true")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = model(tokens)[..., :VOCAB]
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-4


@pytest.mark.parametrize(
    "family, hf_window, sets",
    [
        ("Mistral", dict(sliding_window=5), []),
        (
            "Qwen2",
            dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
            ["model.qkv_bias=true", "model.full_attention_layers=1"],
        ),
    ],
)
def test_sliding_window_attention_equals_transformers_logits(family, hf_window, sets):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**COMMON, head_dim=HEAD_DIM, **hf_window)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    model = ours_of(hf_model, "model.sliding_window=5", *sets)
    unwindowed = ours_of(hf_model, *(s for s in sets if "full_attention" not in s))
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got, without = model(tokens)[..., :VOCAB], unwindowed(tokens)[..., :VOCAB]
    scale = expected.abs().max()
    assert ((got - expected).abs().max() / scale).item() < 1e-4
    # A window of 5 in 16 positions changes the logits: the comparison sees it.
    assert ((without - expected).abs().max() / scale).item() > 1e-2
