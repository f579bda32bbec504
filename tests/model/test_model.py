"""The whole model at tp = 2 and 4 equals tp = 1: the same full weights at init, the same
logits and loss, the same gradient of every parameter (fp32, relative error < 1e-5); also with
Qwen-style attention (q, k, v biases, q and k norms, a sliding window after the first block)
multi-head latent attention, multi-token prediction and Qwen3.5's hybrid (Gated DeltaNet and
gated attention, dense and MoE)."""

from __future__ import annotations

import functools

import pytest
import torch

from megatronish.accounting.parameters import local_parameter_count, tp_summed_grad_count
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.layers.roles import role
from megatronish.model import GPT
from megatronish.objectives.registry import sequence_losses
from tests.ranks import run_on_ranks
from tests.tolerances import FP32_REORDER

VOCAB = 61
SEQ = 12
QWEN3_5 = [
    "model.arch=qwen3_5",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.d_model=32",
    "model.head_dim=12",
    "model.partial_rotary_factor=0.5",
    "model.layer_types=[linear_attention, full_attention]",
    "model.linear_num_key_heads=2",
    "model.linear_num_value_heads=4",
    "model.linear_key_head_dim=8",
    "model.linear_value_head_dim=6",
]
ARCH_SETTINGS = {
    "gpt2": ["model.arch=gpt2", "model.n_head=4", "model.d_model=24"],
    "llama": ["model.arch=llama", "model.n_head=8", "model.n_kv_head=4", "model.d_model=32"],
    # Heads of 6 on d_model 32: the qkv projection 96 wide, the output projection 48 -> 32.
    "llama_head_dim": [
        "model.arch=llama",
        "model.n_head=8",
        "model.n_kv_head=4",
        "model.d_model=32",
        "model.head_dim=6",
    ],
    # Qwen-style attention: biases on q, k and v (their rows split over tp with the heads), the
    # per-head norms of q and k (replicated; each rank's gradient covers its heads), yarn RoPE
    # scaling (the same table on every rank) and a sliding window of 5 of the 12 positions in
    # the second block; and two multi-token prediction modules (the loss includes theirs).
    "llama_qwen": [
        "model.arch=llama",
        "model.n_head=8",
        "model.n_kv_head=4",
        "model.d_model=32",
        "model.head_dim=6",
        "model.qkv_bias=true",
        "model.qk_norm=true",
        "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 16}",
        "model.sliding_window=5",
        "model.full_attention_layers=1",
        "model.mtp_depth=2",
    ],
    # Qwen3.5's hybrid: a Gated DeltaNet block (2 query-key heads of 8, 4 value heads of 6),
    # then gated attention: each query head's output gate in the qkv rows of its kv group
    # (split over tp with the heads), RoPE on the first 6 of each head's 12 dims, and every
    # norm (the blocks', the final one, q and k's) scaling by 1 + its zero-initialized weight.
    "qwen3_5": QWEN3_5,
    # Qwen3.5-MoE: the gated attention above, 4 experts (top 2) in every block, and a shared
    # expert under its sigmoid gate (replicated; each rank's gradient covers its tokens under
    # sequence parallelism).
    "qwen3_5_moe": [
        *QWEN3_5,
        "model.moe.num_experts=4",
        "model.moe.d_ff=20",
    ],
    # Gemma 3: sandwich norms of 1 + weight (four a block, replicated; each rank's gradient
    # covering its tokens under sequence parallelism), GeGLU, scaled and tied embeddings, a
    # sliding block (its own RoPE base) then a global one (linear RoPE), the scores scaled by
    # query_pre_attn_scalar^-0.5 and soft-capped, the logits soft-capped on each vocab shard.
    "gemma3": [
        "model.arch=gemma3",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.d_model=32",
        "model.head_dim=12",
        "model.query_pre_attn_scalar=10",
        "model.sliding_window=5",
        "model.layer_types=[sliding_attention, full_attention]",
        "model.rope_scaling={type: linear, factor: 4}",
        "model.attn_logit_softcapping=2",
        "model.final_logit_softcapping=3",
    ],
    # Multi-head latent attention (DeepSeek-V3): heads split over tp, the replicated
    # down-projections and their norms (each rank's gradient covering its tokens under sequence
    # parallelism), YaRN with its softmax scale, a sliding window in the second block, and its
    # attention core recomputed in backward (selective recompute); a multi-token prediction
    # module whose block is latent attention too.
    "mla": [
        "model.arch=deepseek_v3",
        "model.n_head=4",
        "model.d_model=32",
        "model.mla.q_lora_rank=24",
        "model.mla.kv_lora_rank=16",
        "model.mla.qk_nope_head_dim=8",
        "model.mla.qk_rope_head_dim=4",
        "model.mla.v_head_dim=6",
        "model.mtp_depth=1",
        "model.rope_scaling.original_max_position_embeddings=4",
        "model.sliding_window=5",
        "model.full_attention_layers=1",
        "train.activation_checkpointing=selective",
    ],
}


def make_config(arch: str, tp: int, sequence_parallel: bool = False):
    overrides = ARCH_SETTINGS[arch] + [
        "model.n_layer=2",
        f"model.vocab_size={VOCAB}",
        "model.max_seq_len=16",
        f"train.seq_len={SEQ}",
        f"parallel.tp={tp}",
        f"parallel.sequence_parallel={str(sequence_parallel).lower()}",
        "train.seed=7",
    ]
    return load_config(None, overrides)


def batch():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (3, SEQ), generator=gen)
    targets[0, :2] = -100
    return tokens, targets


def run_model(model: GPT):
    """Logits of this rank, loss, and {name: (weight, grad)} after one backward."""
    tokens, targets = batch()
    logits = model(tokens)
    loss = sequence_losses(model, tokens, targets).total
    loss.backward()
    params = {
        name: (
            p.detach().clone(),
            p.grad.detach().clone(),
            split_dim(p),
            role(p).sequence_parallel_grad,
        )
        for name, p in model.named_parameters()
    }
    return logits.detach(), float(loss.detach()), params


def split_dim(param) -> int | None:
    """The dim of param that tp splits (stacked experts: one expert's, after the stack's)."""
    tags = role(param)
    if tags.tp_split_dim is None:
        return None
    return tags.tp_split_dim + param.dim() - len(tags.full_shape)


def _parallel_worker(rank, world, arch, sequence_parallel):
    cfg = make_config(arch, world, sequence_parallel)
    derived = derive(cfg, world)
    ps = ParallelState.from_world(tp=world, dp=1)
    return run_model(GPT(cfg, derived, ps))


@functools.cache
def reference(arch: str):
    cfg = make_config(arch, 1)
    return run_model(GPT(cfg, derive(cfg, 1), ParallelState.single()))


def check_parameter_counts(arch: str, tp: int, sequence_parallel: bool, params: dict) -> None:
    """The accounting counts a tp rank's parameters, and those whose gradients sum over tp."""
    cfg = make_config(arch, tp, sequence_parallel)
    local = sum(p[0].numel() for p in params.values())
    assert local_parameter_count(cfg, derive(cfg, tp)) == local, "a tp rank's parameter count"
    summed = sum(p[0].numel() for p in params.values() if p[3])
    assert tp_summed_grad_count(cfg, derive(cfg, tp)) == summed, "gradients summed over tp"


def full(shards: list[torch.Tensor], split_dim: int | None, name: str) -> torch.Tensor:
    tensor = shards[0] if split_dim is None else torch.cat(shards, dim=split_dim)
    if name in ("tok_emb.weight", "lm_head.weight"):
        tensor = tensor[:VOCAB]  # padding rows depend on tp; the real vocab rows do not
    return tensor


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / (b.abs().max() + 1e-12)).item()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama_head_dim"])
@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (4, False), (2, True)])
def test_model_at_tp_equals_tp1_weights_logits_loss_and_every_gradient(arch, tp, sequence_parallel):
    check_tp_parity(arch, tp, sequence_parallel)


@pytest.mark.parametrize("arch", ["llama_qwen", "mla"])
@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (2, True)])
def test_qwen_and_latent_attention_at_tp_equal_tp1_weights_logits_loss_and_every_gradient(
    arch, tp, sequence_parallel
):
    check_tp_parity(arch, tp, sequence_parallel)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (2, True)])
def test_qwen3_5_hybrid_at_tp_equals_tp1_weights_logits_loss_gradients_and_counted_params(
    arch, tp, sequence_parallel
):
    check_tp_parity(arch, tp, sequence_parallel)


def test_gemma3_at_tp2_with_sequence_parallelism_equals_tp1_and_its_counted_params():
    check_tp_parity("gemma3", 2, True)


def check_tp_parity(arch: str, tp: int, sequence_parallel: bool) -> None:
    """arch's model at tp (with sequence_parallel) equals tp 1: full weights, logits, loss and
    every parameter's full gradient; and the accounting's parameter counts."""
    ref_logits, ref_loss, ref_params = reference(arch)
    results = run_on_ranks(_parallel_worker, tp, arch, sequence_parallel, timeout=180)
    logits = torch.cat([r[0] for r in results], dim=-1)[..., :VOCAB]
    assert rel_err(logits, ref_logits[..., :VOCAB]) < FP32_REORDER
    assert abs(results[0][1] - ref_loss) / ref_loss < FP32_REORDER
    assert all(r[1] == results[0][1] for r in results), "every tp rank reports the same loss"
    check_parameter_counts(arch, tp, sequence_parallel, results[0][2])
    for name, (ref_weight, ref_grad, _, _) in ref_params.items():
        split, partial = results[0][2][name][2:]
        weight = full([r[2][name][0] for r in results], split, name)
        grad = full([r[2][name][1] for r in results], split, name)
        assert torch.equal(weight, full([ref_weight], None, name)), f"{name}: init differs"
        if partial:
            # Replicated parameters inside the sequence-parallel region see 1/tp of the
            # sequence each; the trainer sums their gradients over the tp group.
            grad = sum(r[2][name][1] for r in results)
        assert rel_err(grad, full([ref_grad], None, name)) < FP32_REORDER, name
