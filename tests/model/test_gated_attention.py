"""Qwen3.5's gated full attention (model.arch qwen3_5) in one process: it equals transformers'
Qwen3_5Attention given the same weights (the output gate interleaved per head in q_proj, q and
k norms scaling by 1 + weight, RoPE on the first partial_rotary_factor of each head), every
norm of the model is zero-centered, and its cached decode equals the full forward, also under
document masks (tp 2 against tp 1: tests/model/test_model.py)."""

from __future__ import annotations

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.context import documents_of
from megatronish.distributed.layout import ParallelState
from megatronish.hf.qwen3_5 import qkv_to_hf
from megatronish.inference.decode import decode_step
from megatronish.model import GPT
from megatronish.model.norm import Norm
from tests.conftest import CONFIGS, invoke_cli
from tests.tolerances import EXACT, FP32_REORDER

SEQ = 12
VOCAB = 61
GATED = [
    "model.arch=qwen3_5",
    "model.n_layer=2",
    "model.n_head=6",
    "model.n_kv_head=2",
    "model.d_model=40",
    "model.head_dim=16",
    f"model.vocab_size={VOCAB}",
    "model.max_seq_len=16",
    f"train.seq_len={SEQ}",
]


def gated_model(*sets: str) -> GPT:
    cfg = load_config(None, [*GATED, *sets])
    torch.manual_seed(0)
    return GPT(cfg, derive(cfg, 1), ParallelState.single())


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter of module random (norm weights too: a zero one would hide the 1 +)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_gated_attention_equals_transformers_qwen3_5_attention(factor):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5Attention,
        Qwen3_5TextRotaryEmbedding,
    )

    ours = gated_model(f"model.partial_rotary_factor={factor}").blocks["0"].attn.eval()
    randomize(ours, 3)
    config = Qwen3_5TextConfig(
        hidden_size=40,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": factor,
        },
        attn_implementation="eager",
    )
    theirs = Qwen3_5Attention(config, layer_idx=3).eval()
    with torch.no_grad():
        for name, weight in zip(("q", "k", "v"), qkv_to_hf(ours.qkv.weight, 6, 2, 16)):
            getattr(theirs, f"{name}_proj").weight.copy_(weight)
        theirs.o_proj.weight.copy_(ours.proj.weight)
        theirs.q_norm.weight.copy_(ours.q_norm.weight)
        theirs.k_norm.weight.copy_(ours.k_norm.weight)
    x = torch.randn(2, SEQ, 40, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(SEQ)[None].expand(2, -1)
    cos_sin = Qwen3_5TextRotaryEmbedding(config)(x, positions)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    expected, _ = theirs(x, cos_sin, mask)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected, rtol=FP32_REORDER, atol=FP32_REORDER)


def test_every_norm_scales_by_one_plus_its_zero_initialized_weight():
    model = gated_model()
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1  # two per block, q and k's, the final one
    assert all(m.offset == 1.0 and not m.weight.any() for m in norms)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    rms = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    norm = model.blocks["0"].attn.q_norm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-1, 1, 16))
        torch.testing.assert_close(norm(x), rms * (1 + norm.weight), rtol=EXACT, atol=FP32_REORDER)


def test_gated_attention_cached_decode_equals_the_full_forward():
    model = gated_model()
    randomize(model, 6)
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens)
        cache: list = []
        steps = [decode_step(model, tokens[:, :7], cache, 0)]
        steps += [decode_step(model, tokens[:, i : i + 1], cache, i) for i in range(7, SEQ)]
    got = torch.cat(steps, dim=1)[..., :VOCAB]
    torch.testing.assert_close(got, full[..., :VOCAB], rtol=FP32_REORDER, atol=FP32_REORDER)


def test_under_document_masks_each_document_is_rotated_and_gated_as_if_alone():
    model = gated_model()
    randomize(model, 7)
    model.eval()
    tokens = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(8))
    tokens[0, 4] = 0  # the end of the first document: the second starts at position 5
    documents = documents_of(tokens, 0)
    with torch.no_grad():
        both = model(tokens, documents)
        second = model(tokens[:, 5:])
    torch.testing.assert_close(both[:, 5:], second, rtol=FP32_REORDER, atol=FP32_REORDER)


@pytest.mark.parametrize(
    "sets, needles",
    [
        ([*GATED, "model.partial_rotary_factor=0"], ["model.partial_rotary_factor: 0", "<= 1"]),
        ([*GATED, "model.partial_rotary_factor=0.3125"], ["rotates 5 of head_dim 16", "even"]),
        (["model.arch=gpt2", "model.partial_rotary_factor=0.5"], ["needs RoPE attention"]),
    ],
)
def test_a_bad_partial_rotary_factor_is_exit_2_with_one_line_naming_the_key(sets, needles):
    args = [x for s in sets for x in ("--set", s)]
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.usefixtures("interpreter_env")
def test_gated_model_on_the_triton_kernels_equals_the_torch_ops_forward_and_backward():
    """The rope kernel rotates the leading quarter of each head, the norm kernel scales by the
    1 + weight it is given (Triton's interpreter on CPU; fp32)."""
    from tests.kernel_env import kernels  # noqa: F401 (defines the kernels for the interpreter)

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    results = []
    for backend in ("torch", "triton"):
        model = gated_model("model.n_layer=1", f"kernels.backend={backend}")
        randomize(model, 10)
        logits = model(tokens)[..., :VOCAB]
        logits.sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=FP32_REORDER, atol=FP32_REORDER)
    for name, grad in want_grads.items():
        scale = grad.abs().max()
        assert (got_grads[name] - grad).abs().max() <= FP32_REORDER * scale, name
