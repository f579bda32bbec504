"""QK-clip (optim.muon.qk_clip_tau, MuonClip): each head's largest logit counts the pairs the
masks let through only; after a step the head over tau has its query and key rows scaled as
computed by hand (GQA: the shared key by the group's factor; MLA: the paper's split), so that
its largest logit becomes tau; the run logs max_attn_logit; a tau <= 0, or one on a model with
q/k norms or LoRA (frozen q and k weights), is one line. The same result at every layout:
tests/optim/test_muon_layouts.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.model.logit_max import head_logit_max
from megatronish.ops import reference
from megatronish.optim.qk_clip import QKClip
from tests.conftest import CONFIGS, invoke_cli, read_metrics
from tests.parity import assert_check_fails_with_one_line
from tests.tolerances import EXACT, FP32_FEW_OPS_REL, FP32_REORDER, FP64_REORDER

TAU = 1.0
BOOST = 200.0  # head 1's query rows times this: its logits far over TAU, the others' under
SEQ = 12
SHAPE = ["model.n_layer=1", "model.d_model=32", "model.vocab_size=61", "model.max_seq_len=16"]
GQA = ["model.arch=llama", "model.n_head=4", "model.n_kv_head=2", *SHAPE]
MLA = [
    "model.arch=deepseek_v3",
    "model.n_head=4",
    *SHAPE,
    "model.mla.kv_lora_rank=16",
    "model.mla.qk_nope_head_dim=8",
    "model.mla.qk_rope_head_dim=4",
    "model.mla.v_head_dim=6",
]
CLIP = ["optim.name=muon", f"optim.muon.qk_clip_tau={TAU}", f"train.seq_len={SEQ}"]


def test_a_heads_largest_logit_counts_only_the_pairs_the_masks_let_through():
    gen = torch.Generator().manual_seed(0)
    b, n, kv, s, d, window, scale = 2, 4, 2, 9, 5, 3, 0.3
    q = torch.randn(b, n, s, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv, s, d, generator=gen, dtype=torch.float64)
    k[:, :, -1] *= 100  # the last key: the largest logits, seen by the last query only
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1, 1]])
    visible = reference.attention_mask(s, q.device, True, segments, window)
    got = head_logit_max(q, k, scale, visible)
    for head in range(n):
        want = max(
            float(q[i, head, a] @ k[i, head // (n // kv), j]) * scale
            for i in range(b)
            for a in range(s)
            for j in range(s)
            if j <= a and a - j < window and segments[i, a] == segments[i, j]
        )
        assert got[head].item() == pytest.approx(want, rel=FP64_REORDER)


def _boosted(sets: list[str], query) -> tuple[GPT, torch.Tensor]:
    """A one-layer model whose head 1 has its query rows (query(attention) [heads, rows, in])
    times BOOST, and each head's largest logit over one training forward."""
    cfg = load_config(None, [*sets, *CLIP])
    torch.manual_seed(0)
    model = GPT(cfg, derive(cfg, 1), ParallelState.single()).train()
    with torch.no_grad():
        query(model.blocks["0"].attn)[1] *= BOOST
    return model, _largest_logits(model)


def _largest_logits(model: GPT) -> torch.Tensor:
    tokens = torch.randint(0, 61, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model(tokens)
    return model.blocks["0"].attn.logit_max.value.clone()


def _clip(model: GPT, sets: list[str]) -> dict[str, torch.Tensor]:
    """The attention's weights before QK-clip's step, then clipped in place."""
    before = {n: p.detach().clone() for n, p in model.blocks["0"].attn.named_parameters()}
    cfg = load_config(None, [*sets, *CLIP])
    QKClip(model, cfg, ParallelState.single()).after_step(applied=True)
    return before


def _gqa_rows(attention) -> torch.Tensor:
    """The fused qkv weight by kv group: [groups, 2 query heads + key + value, d, in]."""
    weight = attention.qkv.weight
    return weight.view(attention.local_groups, -1, attention.head_dim, weight.shape[1])


def test_qk_clip_scales_a_gqa_heads_query_and_its_groups_key_by_the_square_root():
    model, maxima = _boosted(GQA, lambda attn: _gqa_rows(attn)[0])  # group 0's query rows
    assert maxima[1] > TAU and (maxima[[0, 2, 3]] < TAU).all()  # head 1 of group 0 only
    before = _clip(model, GQA)
    attention = model.blocks["0"].attn
    now, was = _gqa_rows(attention), before["qkv.weight"].view_as(_gqa_rows(attention))
    root = math.sqrt(TAU / maxima[1].item())  # by hand, in fp64
    # group 0: head 1's query and the key it shares with head 0 by root; head 0's query and
    # the value as they were; group 1 untouched
    assert torch.allclose(now[0, 1], was[0, 1] * root, rtol=FP32_FEW_OPS_REL, atol=EXACT)
    assert torch.allclose(now[0, 2], was[0, 2] * root, rtol=FP32_FEW_OPS_REL, atol=EXACT)
    assert torch.equal(now[0, 0], was[0, 0]) and torch.equal(now[0, 3], was[0, 3])
    assert torch.equal(now[1], was[1])
    after = _largest_logits(model)
    assert after[1].item() == pytest.approx(TAU, rel=FP32_REORDER)  # clipped to tau
    assert after[0].item() == pytest.approx(maxima[0].item() * root, rel=FP32_REORDER)
    assert torch.allclose(after[2:], maxima[2:], rtol=FP32_REORDER, atol=EXACT)


def test_qk_clip_splits_mla_heads_as_the_paper_nope_by_the_root_rope_query_by_the_factor():
    model, maxima = _boosted(MLA, lambda attn: attn.q_b.weight.view(4, 12, -1))  # q_lora
    assert maxima[1] > TAU and (maxima[[0, 2, 3]] < TAU).all()
    before = _clip(model, MLA)
    attention, gamma = model.blocks["0"].attn, TAU / maxima[1].item()
    q, q_was = attention.q_b.weight.view(4, 12, -1), before["q_b.weight"].view(4, 12, -1)
    kv, kv_was = attention.kv_b.weight.view(4, 14, -1), before["kv_b.weight"].view(4, 14, -1)
    rel = dict(rtol=FP32_FEW_OPS_REL, atol=EXACT)
    assert torch.allclose(q[1, :8], q_was[1, :8] * math.sqrt(gamma), **rel)  # query nope
    assert torch.allclose(q[1, 8:], q_was[1, 8:] * gamma, **rel)  # query rope: the factor
    assert torch.allclose(kv[1, :8], kv_was[1, :8] * math.sqrt(gamma), **rel)  # key nope
    assert torch.equal(kv[1, 8:], kv_was[1, 8:])  # the values
    for head in (0, 2, 3):
        assert torch.equal(q[head], q_was[head]) and torch.equal(kv[head], kv_was[head])
    for name in ("kv_a.weight", "q_a.weight"):  # the shared rope key; the query's latent
        assert torch.equal(attention.get_parameter(name), before[name])
    after = _largest_logits(model)
    assert after[1].item() == pytest.approx(TAU, rel=FP32_REORDER)
    assert torch.allclose(after[[0, 2, 3]], maxima[[0, 2, 3]], rtol=FP32_REORDER, atol=EXACT)


def test_a_run_with_qk_clip_logs_max_attn_logit_every_logged_step(tmp_path):
    sets = [*GQA, "optim.name=muon", "optim.muon.qk_clip_tau=0.05", "train.seq_len=16"]
    sets += ["train.steps=2", "train.log_every=1", "train.eval_every=0"]
    sets += ["train.global_batch_size=8"]
    sets += [f"run.out_dir={tmp_path}", "checkpoint.save=false", "model.vocab_size=null"]
    args = ["--config", str(CONFIGS / "tiny.yaml"), *(a for s in sets for a in ("--set", s))]
    result = invoke_cli("train", *args)
    assert result.returncode == 0, result.stderr[-2000:]
    train, _ = read_metrics(tmp_path)
    assert [line["step"] for line in train] == [1, 2]
    assert all(0 < line["max_attn_logit"] < math.inf for line in train)


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["optim.muon.qk_clip_tau=-1"], "optim.muon.qk_clip_tau"),
        (["model.arch=qwen3", "optim.muon.qk_clip_tau=10"], "model.qk_norm"),
        (["model.arch=llama", "model.lora.rank=4", "optim.muon.qk_clip_tau=10"], "model.lora"),
    ],
)
def test_a_tau_not_above_zero_or_on_q_k_norms_or_lora_is_one_line_naming_its_keys(sets, key):
    args = ["--config", str(CONFIGS / "tiny.yaml"), "--set", "optim.name=muon"]
    for s in sets:
        args += ["--set", s]
    assert_check_fails_with_one_line(args, key)
