"""Multi-token prediction (model.mtp_depth): the loss equals a plain torch reference of
DeepSeek-V3's modules on the same weights; the tokens and targets ahead of a cp rank's zigzag
shard are those of the whole sequence; evaluation reports the main loss alone; bad settings
are one line. (Every layout's parity with one process is in the shared parity runs.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatronish.config import derive, load_config
from megatronish.context.zigzag import unshard_sequence
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.model.mtp import future_tokens_of, shard_future_tokens
from megatronish.objectives.cross_entropy import mean_cross_entropy
from megatronish.objectives.registry import sequence_losses
from tests.conftest import CONFIGS
from tests.parity import assert_check_fails_with_one_line
from tests.tolerances import FP32_FEW_OPS_REL, FP32_REORDER

VOCAB, SEQ = 53, 12


def build(depth: int) -> GPT:
    cfg = load_config(
        None,
        [
            "model.arch=llama",
            "model.n_layer=2",
            "model.n_head=4",
            "model.n_kv_head=2",
            "model.d_model=32",
            f"model.vocab_size={VOCAB}",
            "model.max_seq_len=16",
            f"train.seq_len={SEQ}",
            f"model.mtp_depth={depth}",
            "model.mtp_loss_coef=0.25",
            "train.seed=3",
        ],
    )
    return GPT(cfg, derive(cfg, 1), ParallelState.single())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    sequence = torch.randint(0, VOCAB, (3, SEQ + 1), generator=gen)
    targets = sequence[:, 1:].clone()
    targets[1, 4] = -100  # a loss-masked target: not counted at depth 0, nor 4 - k at depth k
    return sequence[:, :-1], targets


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mtp_loss(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 section 2.2 in plain torch, chained as transformers' MtpModel chains it:
    h^0 the main model's output after its final norm, h^k = rms_k(block_k(eh_proj(
    [rms(emb(t_{i+k})); rms(h^{k-1}_i)]))), the loss of depth k the mean cross-entropy of the
    output layer on h^k_i against t_{i+k+1} over the positions that have one; the mean over k."""
    s = tokens.shape[1]
    hidden = rms(model.stage_forward(tokens), model.norm_f.weight)  # h^0
    losses = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        ahead = tokens[:, k:]  # t_{i+k} for the positions i < s - k that have a target
        emb = model.tok_emb.weight[ahead]
        joined = torch.cat(
            [rms(emb, layer.enorm.weight), rms(hidden[:, : s - k], layer.hnorm.weight)], -1
        )
        x = joined @ layer.eh_proj.weight.T
        hidden = rms(layer.block(x), layer.norm.weight)
        logits = hidden @ model.lm_head.weight[:VOCAB].T
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten()))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_equals_a_plain_torch_reference_on_the_same_weights(depth):
    model = build(depth)
    tokens, targets = batch()
    losses = sequence_losses(model, tokens, targets)
    main, mtp = losses.main, losses.mtp
    # The positions past s - k are causal padding: the reference never computes them, so its
    # depth-2 hidden states see only real tokens, as the model's counted positions do.
    want = reference_mtp_loss(model, tokens, targets)
    assert abs(mtp.item() - want.item()) <= FP32_REORDER * want.item()
    plain = mean_cross_entropy(model(tokens), targets, None, model.ps, model.backend)
    assert main.item() == pytest.approx(plain.item())
    objective = losses.total
    assert objective.item() == pytest.approx(main.item() + 0.25 * mtp.item(), rel=FP32_FEW_OPS_REL)
    objective.backward()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0
    model.eval()
    assert sequence_losses(model, tokens, targets).mtp is None  # evaluation: the main loss alone


def test_the_tokens_ahead_of_a_cp_shard_are_the_whole_sequences():
    tokens, targets = batch()
    future = future_tokens_of(tokens, targets, 2)  # [b, 2, D, s]
    assert torch.equal(future[:, 0, 1, :-2], tokens[:, 2:])
    assert torch.equal(future[:, 1, 0, :-1], targets[:, 1:])
    assert (future[:, 1, 1, -2:] == -100).all()
    shards = [shard_future_tokens(future, 3, rank) for rank in range(3)]  # chunks of 2 of 12
    assert torch.equal(unshard_sequence(shards, dim=3), future)
    # cp rank 0's first chunk ends at position 1: its token 2 ahead is position 3's, which
    # another cp rank holds.
    assert torch.equal(shards[0][:, 0, 1, 1], tokens[:, 3])


@pytest.mark.parametrize(
    "sets, key",
    [
        (["model.mtp_depth=-1"], "model.mtp_depth"),
        (["model.mtp_depth=16", "train.seq_len=16"], "model.mtp_depth"),
        (["model.mtp_depth=1", "model.mtp_loss_coef=-0.1"], "model.mtp_loss_coef"),
    ],
)
def test_cli_bad_mtp_settings_exit_2_with_one_line(sets, key):
    args = ["--config", str(CONFIGS / "tiny.yaml")]
    for s in ["model.arch=llama", *sets]:
        args += ["--set", s]
    assert_check_fails_with_one_line(args, key)


def test_a_resumed_run_may_change_the_mtp_loss_coef_but_not_the_depth(tmp_path):
    from megatronish.checkpoint.model_match import model_differences, refuse_other_model
    from megatronish.errors import UserError

    saved = build(1).cfg
    lowered = dataclasses.replace(saved, model=dataclasses.replace(saved.model, mtp_loss_coef=0.1))
    deeper = dataclasses.replace(saved, model=dataclasses.replace(saved.model, mtp_depth=2))
    kept = refuse_other_model(model_differences(saved, VOCAB, lowered, VOCAB), tmp_path, "", "")
    assert kept == [("model.mtp_loss_coef", 0.25, 0.1)]  # DeepSeek-V3's 0.3 -> 0.1
    with pytest.raises(UserError, match="model.mtp_depth"):
        refuse_other_model(model_differences(saved, VOCAB, deeper, VOCAB), tmp_path, "", "")
