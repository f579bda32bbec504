"""Multi-head latent attention (model.attention mla) in one process: it equals transformers'
DeepseekV3Attention given the same weights (interleaved RoPE, YaRN's softmax scale, with and
without the queries' low-rank path), and its cached decode (latents only) equals the full
forward; bad settings are one line."""

from __future__ import annotations

import pytest
import torch

from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.inference.decode import decode_step
from megatronish.model import GPT
from tests.conftest import CONFIGS, invoke_cli
from tests.tolerances import FP32_REORDER

SEQ = 12
MLA = [
    "model.arch=deepseek_v3",
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=32",
    "model.vocab_size=61",
    "model.max_seq_len=16",
    f"train.seq_len={SEQ}",
    "model.mla.kv_lora_rank=16",
    "model.mla.qk_nope_head_dim=8",
    "model.mla.qk_rope_head_dim=4",
    "model.mla.v_head_dim=6",
    "model.rope_scaling.original_max_position_embeddings=4",
]


def mla_model(*sets: str) -> GPT:
    cfg = load_config(None, [*MLA, *sets])
    torch.manual_seed(0)
    return GPT(cfg, derive(cfg, 1), ParallelState.single())


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_latent_attention_equals_transformers_deepseek_v3_attention(q_lora_rank):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    rank = "null" if q_lora_rank is None else q_lora_rank
    ours = mla_model(f"model.mla.q_lora_rank={rank}").blocks["0"].attn.eval()
    mla, scaling = ours.nope, {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=mla,
        qk_rope_head_dim=4,
        v_head_dim=6,
        rms_norm_eps=1e-6,
        max_position_embeddings=16,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            **scaling,
        },
        attn_implementation="sdpa",
    )
    theirs = DeepseekV3Attention(config, layer_idx=0).eval()
    names = {
        "kv_a_proj_with_mqa": ours.kv_a,
        "kv_a_layernorm": ours.kv_a_norm,
        "kv_b_proj": ours.kv_b,
        "o_proj": ours.proj,
    }
    if q_lora_rank is None:
        names["q_proj"] = ours.q
    else:
        names |= {"q_a_proj": ours.q_a, "q_a_layernorm": ours.q_a_norm, "q_b_proj": ours.q_b}
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, module in names.items():
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.3 + 0.1)
            getattr(theirs, name).weight.copy_(module.weight)
    x = torch.randn(2, SEQ, 32, generator=gen)
    positions = torch.arange(SEQ)[None].expand(2, -1)
    cos_sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    expected, _ = theirs(x, cos_sin, None)
    torch.testing.assert_close(ours(x), expected, rtol=FP32_REORDER, atol=FP32_REORDER)


def test_cached_decode_holds_the_latents_and_equals_the_full_forward():
    model = mla_model("model.mla.q_lora_rank=12").eval()
    tokens = torch.randint(0, 61, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens)
        cache: list = []
        steps = [decode_step(model, tokens[:, :7], cache, 0)]
        steps += [decode_step(model, tokens[:, i : i + 1], cache, i) for i in range(7, SEQ)]
    assert [tuple(t.shape) for t in cache[0]] == [(2, SEQ, 16), (2, SEQ, 4)]
    torch.testing.assert_close(torch.cat(steps, dim=1)[..., :61], full[..., :61])


def test_latent_attention_sees_only_the_keys_inside_its_sliding_window():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, SEQ, 32, generator=gen)
    moved = x.clone()
    moved[:, 0] += torch.randn(2, 32, generator=gen)
    for window, unchanged in ((None, False), (3, True)):
        sets = ["model.mla.q_lora_rank=12", f"model.sliding_window={window or 'null'}"]
        attn = mla_model(*sets).blocks["0"].attn.eval()
        with torch.no_grad():
            # Positions 3.. reach back fewer than 3 keys, position 0 not among them: a masked
            # key's weight is exp(-inf) = 0 exactly, so their outputs are bit for bit the same.
            same = torch.equal(attn(x)[:, 3:], attn(moved)[:, 3:])
        assert same == unchanged, window


TINY_V3 = str(CONFIGS / "tiny-deepseek-v3.yaml")


@pytest.mark.parametrize(
    "config, sets, needles",
    [
        (
            CONFIGS / "tiny.yaml",
            ["model.arch=llama", "model.mla.kv_lora_rank=16"],
            ["model.mla.kv_lora_rank: 16 needs model.attention=mla", "'llama'"],
        ),
        (
            CONFIGS / "tiny.yaml",
            ["model.arch=llama", "model.attention=mla"],
            ["model.mla.kv_lora_rank: missing", "model.mla.v_head_dim"],
        ),
        (
            TINY_V3,
            ["model.attention=mha"],
            ["model.mla.q_lora_rank: 48 needs model.attention=mla", "model.attention is mha"],
        ),
        (TINY_V3, ["model.mla.qk_rope_head_dim=7"], ["model.mla.qk_rope_head_dim: 7", "even"]),
        (TINY_V3, ["model.mla.v_head_dim=0"], ["model.mla.v_head_dim: 0", "positive integer"]),
        (TINY_V3, ["parallel.tp=3"], ["model.n_head: 4 is not divisible by parallel.tp=3"]),
        (TINY_V3, ["model.n_kv_head=2"], ["model.n_kv_head: 2 is not used by model.attention"]),
        (CONFIGS / "tiny.yaml", ["model.attention=mla"], ["model.attention: mla needs the RoPE"]),
        (
            TINY_V3,
            ["kernels.backend=triton", "model.mla.v_head_dim=96"],
            ["model.mla: query-key head dim 24", "v_head_dim 96", "valid value head dims"],
        ),
    ],
)
def test_a_bad_latent_attention_setting_is_exit_2_with_one_line_naming_the_key(
    config, sets, needles
):
    args = [x for s in sets for x in ("--set", s)]
    result = invoke_cli("check", "--config", str(config), *args, env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_deepseek_v3_with_mha_takes_no_latent_sizes_from_the_preset_and_trains(tmp_path):
    sets = ["model.arch=deepseek_v3", "model.attention=mha", "model.n_layer=1", "model.d_model=32"]
    sets += ["model.max_seq_len=16", "train.seq_len=16", "train.micro_batch_size=2"]
    sets += ["train.global_batch_size=2", "train.steps=1", "train.eval_every=0"]
    sets += [f"run.out_dir={tmp_path / 'run'}", "checkpoint.save=false"]
    cfg = load_config(CONFIGS / "tiny.yaml", sets)
    assert cfg.model.attention == "mha" and cfg.model.mla.kv_lora_rank is None
    args = ["--config", str(CONFIGS / "tiny.yaml"), *(a for s in sets for a in ("--set", s))]
    assert invoke_cli("check", *args).returncode == 0
    result = invoke_cli("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("step 1: loss ")
