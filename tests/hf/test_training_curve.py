"""Training from imported weights: a run started from a tiny random transformers model
(checkpoint.init_from_hf) follows, step by step, the loss curve and gradient norms of that model
trained by torch.optim.AdamW under our schedule, clipping and weight-decay groups on the same
batches (tests/hf/curve.py), at tp 1 (all CURVE_STEPS steps) and at tp 2 x pp 2 (the first
LAYOUT_STEPS, a clipped step among them), for every family that imports. A
model with experts trains without router losses here: transformers' loss of the logits has none.

The tolerance is the parity harness's 1e-5 relative per step: both sides do the same fp32
arithmetic in different orders (fused or separate projections, attention, cross entropy, fused
or foreach AdamW, the clipping norm's sums), each op rounding to ~6e-8 relative, which Adam's
normalized update (m / sqrt(v)) passes on unamplified; a loss near 4 has an ulp of 4.8e-7, so
1e-5 is some 80 ulps. A wrong weight-decay group, clipping norm or lr step moves the curves by
3e-5 to 2e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatronish.data import dataset_vocab_size
from megatronish.distributed.layout import ParallelState
from tests.hf.curve import (
    CURVE_STEPS,
    LLAMA_SHAPE,
    decays,
    reference_curve,
    run_settings,
    train_runs,
)
from tests.parity import LAYOUT_STEPS, assert_close, make_config, make_trainer, train_counted
from tests.ranks import run_on_ranks

transformers = pytest.importorskip("transformers")

# Qwen3.5's hybrid blocks (transformers' names): the linear heads split over tp 2 (2 key heads
# of 8 dims, 4 value heads of 12).
HYBRID = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
)

# transformers class -> its tiny model's sizes (fp32, eager attention, the dataset's vocab of 257,
# the parity runs' 16 positions, no dropout; 3 layers: 2 and 1 at pp 2); a family that imports
# joins with its entry.
FAMILIES = {
    "LlamaForCausalLM": dict(LLAMA_SHAPE, rope_theta=5000.0),
    "GPT2LMHeadModel": dict(
        n_embd=40,
        n_inner=72,
        n_layer=3,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "MixtralForCausalLM": dict(
        hidden_size=40,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        rope_theta=5000.0,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    # q, k and v biases and a window of 5 after the first block (tied embeddings: GPT-2's)
    "Qwen2ForCausalLM": dict(
        LLAMA_SHAPE,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
    ),
    # q and k norms, heads of 12 apart from hidden / heads, YaRN
    "Qwen3ForCausalLM": dict(
        LLAMA_SHAPE,
        head_dim=12,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=8
        ),
    ),
    "MistralForCausalLM": dict(LLAMA_SHAPE, sliding_window=6),
    "Qwen3MoeForCausalLM": dict(
        LLAMA_SHAPE,
        head_dim=12,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
    ),
    # the output gate, RoPE on a quarter of each head's 16 dims, 1 + weight norms, and 3 Gated
    # DeltaNet blocks to 1 of that full attention (2 and 2 at pp 2)
    "Qwen3_5ForCausalLM": dict(LLAMA_SHAPE, head_dim=16, **HYBRID),
    # and experts in every block beside the gated shared expert
    "Qwen3_5MoeForCausalLM": dict(
        LLAMA_SHAPE,
        head_dim=16,
        **HYBRID,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=24,
    ),
    # sandwich norms of 1 + weight, GeGLU, scaled and tied embeddings, 2 sliding blocks of
    # window 5 (their own RoPE base) and a global one (linear RoPE scaling), the scores scaled
    # by query_pre_attn_scalar^-0.5 and the logits soft-capped
    "Gemma3ForCausalLM": dict(
        LLAMA_SHAPE,
        tie_word_embeddings=True,
        head_dim=12,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=5,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        final_logit_softcapping=5.0,
    ),
    # sinks, biases everywhere, a window of 4 in the first and last blocks, YaRN, and biased
    # experts behind a clamped SwiGLU whose limit of 0.1 binds on many of the tiny activations
    "GptOssForCausalLM": dict(
        LLAMA_SHAPE,
        head_dim=12,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=0.1,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            original_max_position_embeddings=8,
            truncate=False,
        ),
    ),
}


@pytest.fixture(scope="module")
def hf_dirs(dataset, tmp_path_factory) -> dict[str, Path]:
    """Every family's tiny random model, saved with save_pretrained."""
    root = tmp_path_factory.mktemp("hf-curve")
    for seed, (name, sizes) in enumerate(FAMILIES.items()):
        model_class = getattr(transformers, name)
        config = model_class.config_class(
            vocab_size=dataset_vocab_size(dataset), attn_implementation="eager", **sizes
        )
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model_class(config).save_pretrained(root / name)
    return {name: root / name for name in FAMILIES}


@pytest.fixture(scope="module", params=list(FAMILIES))
def curves(request, hf_dirs, dataset, tmp_path_factory) -> dict:
    """A family's reference curve (transformers + torch.optim.AdamW), our tp 1 run's, and the
    parameters the reference decays; both computed on one thread, as a rank computes (the
    tensors are too small for more to help)."""
    family = request.param
    cfg = make_config(1, 1, 1, run_settings(hf_dirs[family]), dataset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        losses, norms, _ = train_counted(trainer, CURVE_STEPS)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dirs[family], attn_implementation="eager"
        )
        assert type(theirs).__name__ == family and theirs.dtype == torch.float32
        decay = decays(trainer, hf_dirs[family], tmp_path_factory.mktemp("decays") / family)
        ref_losses, ref_norms = reference_curve(theirs, decay, cfg, dataset)
    finally:
        torch.set_num_threads(threads)
    return dict(
        family=family,
        reference={"losses": ref_losses, "norms": ref_norms},
        tp1={"losses": losses, "norms": norms},
        decay=decay,
    )


@pytest.fixture(scope="module")
def four_ranks(hf_dirs, dataset) -> list[dict[str, dict]]:
    """Every family's run at tp 2 x pp 2, in one 4-rank run: each rank's curves of the first
    LAYOUT_STEPS steps (of the same CURVE_STEPS schedule) by family. A step is two
    micro-batches of 4 (at tp 1 four of 2; the loss is the global batch's mean either way),
    which halves the pipeline's per-step cost."""
    micro = ["train.micro_batch_size=4"]
    runs = {family: (2, 2, run_settings(d) + micro) for family, d in hf_dirs.items()}
    return run_on_ranks(train_runs, 4, runs, dataset, LAYOUT_STEPS, timeout=300)


def assert_same_curve(ours: dict, reference: dict, steps: int = CURVE_STEPS) -> None:
    """ours equals the reference's first `steps` steps."""
    assert_close(ours["losses"], reference["losses"][:steps], steps=steps)
    assert_close(ours["norms"], reference["norms"][:steps], steps=steps)


def test_a_run_from_imported_weights_follows_the_transformers_adamw_curve_at_tp1(curves):
    reference = curves["reference"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it learns
    assert max(reference["norms"]) > 1.0  # gradients are clipped (train.grad_clip 1)
    assert any(curves["decay"].values()) and not all(curves["decay"].values())
    assert_same_curve(curves["tp1"], reference)


@pytest.mark.slow  # a 4-rank run
def test_a_run_from_imported_weights_follows_the_transformers_adamw_curve_at_tp2_pp2(
    curves, four_ranks
):
    # a clipped step among those compared (train.grad_clip 1): the norm summed over tp and pp
    assert max(curves["reference"]["norms"][:LAYOUT_STEPS]) > 1.0
    for rank_curves in four_ranks:
        assert_same_curve(rank_curves[curves["family"]], curves["reference"], LAYOUT_STEPS)
