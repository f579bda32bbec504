"""Gated DeltaNet, the linear attention of hybrid models (model.layer_types): the layer equals
transformers' Qwen3_5GatedDeltaNet given the same weights (forward and every gradient, over two
of the rule's chunks); a hybrid model at tp 2, with sequence parallelism and with document
masks, equals tp 1 (weights, logits, loss, every gradient), and so does it at cp 2, tp 2 x cp 2
and cp 3, the state and the convolution tail passed between the cp ranks (their bytes as the
sizes say); document masks restart the state and the convolution at each document; cached
decoding keeps a fixed-size state and equals the full forward; a hybrid trains from the CLI
with tp 1's losses at tp 2 (with and without sequence parallelism), pp 2, dp 2 with ZeRO-3 and
cp 2 (with and without recompute); bad settings are one line."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from megatronish.accounting.collectives import formula_payload_by_kind
from megatronish.config import derive, load_config
from megatronish.context import documents_of, shard_sequence
from megatronish.context.zigzag import unshard_sequence
from megatronish.distributed.bookkeeping import CommCounter
from megatronish.distributed.layout import ParallelState
from megatronish.inference.decode import decode_step
from megatronish.layers.roles import role
from megatronish.model import GPT
from megatronish.model.gated_deltanet import qkv_rows
from megatronish.objectives.cross_entropy import mean_cross_entropy
from tests.conftest import CONFIGS, invoke_cli, read_metrics
from tests.ranks import run_cli_on_ranks, run_on_ranks
from tests.tolerances import (
    FP32_REORDER,
    GATED_DELTA_REL,
    GATED_DELTANET_REL,
    LAYOUT_CURVE_REL,
)

VOCAB = 61
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, KERNEL, D_MODEL = 2, 4, 8, 6, 4, 32
HYBRID = [
    "model.arch=llama",
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_kv_head=2",
    f"model.d_model={D_MODEL}",
    "model.layer_types=[linear_attention, linear_attention, linear_attention, full_attention]",
    f"model.linear_num_key_heads={KEY_HEADS}",
    f"model.linear_num_value_heads={VALUE_HEADS}",
    f"model.linear_key_head_dim={KEY_DIM}",
    f"model.linear_value_head_dim={VALUE_DIM}",
    f"model.linear_conv_kernel_dim={KERNEL}",
]


def hybrid_config(tp: int = 1, seq: int = 12, *sets: str):
    sizes = [f"model.vocab_size={VOCAB}", "model.max_seq_len=80", f"train.seq_len={seq}"]
    return load_config(None, [*HYBRID, *sizes, f"parallel.tp={tp}", "train.seed=7", *sets])


def hybrid_layer(seq: int):
    cfg = hybrid_config(1, seq)
    return GPT(cfg, derive(cfg, 1), ParallelState.single()).blocks["0"].attn


def theirs_of(ours):
    """transformers' Qwen3_5GatedDeltaNet with ours's weights (its [q; k; v] rows in order)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=D_MODEL,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM,
        linear_value_head_dim=VALUE_DIM,
        linear_conv_kernel_dim=KERNEL,
        rms_norm_eps=1e-5,  # model.norm_eps's default
    )
    theirs = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    rows = qkv_rows(KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    with torch.no_grad():
        theirs.in_proj_qkv.weight[rows] = ours.in_proj_qkv.weight
        theirs.conv1d.weight[rows, 0] = ours.conv_weight
        for name in ("in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "norm"):
            getattr(theirs, name).weight.copy_(getattr(ours, name).weight)
        theirs.A_log.copy_(ours.A_log)
        theirs.dt_bias.copy_(ours.dt_bias)
    return theirs, rows


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / (b.abs().max() + 1e-12)).item()


def test_gated_deltanet_equals_transformers_qwen3_5_forward_and_every_gradient():
    seq = 70  # two of the rule's chunks of 64: the state passes between them
    ours = hybrid_layer(seq)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in ours.parameters():  # values of magnitude ~1 through every path
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + 0.1)
    theirs, rows = theirs_of(ours)
    x = torch.randn(2, seq, D_MODEL, generator=gen)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = ours(x_ours), theirs(x_theirs)
    assert rel_err(out, expected) < GATED_DELTANET_REL
    upstream = torch.randn(out.shape, generator=gen)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert rel_err(x_ours.grad, x_theirs.grad) < GATED_DELTANET_REL
    grads = {
        "in_proj_qkv.weight": theirs.in_proj_qkv.weight.grad[rows],
        "conv_weight": theirs.conv1d.weight.grad[rows, 0],
        "A_log": theirs.A_log.grad,
        "dt_bias": theirs.dt_bias.grad,
    }
    for name in ("in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "norm"):
        grads[f"{name}.weight"] = getattr(theirs, name).weight.grad
    for name, param in ours.named_parameters():
        assert rel_err(param.grad, grads[name]) < GATED_DELTANET_REL, name


def test_document_masks_restart_the_state_and_the_convolution_at_each_document():
    layer = hybrid_layer(12).eval()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, D_MODEL, generator=gen)
    tokens = torch.ones(2, 12, dtype=torch.long)
    tokens[0, [3, 7]] = tokens[1, 10] = 0  # documents end at these tokens (eod id 0)
    with torch.no_grad():
        masked = layer(x, documents_of(tokens, 0))
        alone = [
            torch.cat([layer(x[:1, a:b]) for a, b in ((0, 4), (4, 8), (8, 12))], dim=1),
            torch.cat([layer(x[1:, a:b]) for a, b in ((0, 11), (11, 12))], dim=1),
        ]
        unmasked = layer(x)
    assert rel_err(masked, torch.cat(alone)) < FP32_REORDER
    assert rel_err(masked[0, 4:], unmasked[0, 4:]) > FP32_REORDER, "the documents differ"


def batch():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=gen)
    # Documents end there under document masks (eod id 0): at cp 2 the second starts a zigzag
    # piece and the third starts inside the convolution tail of the piece after it.
    tokens[:, [2, 7]] = 0
    return tokens, torch.randint(0, VOCAB, (3, 12), generator=gen)


def run_model(model: GPT, document_mask: bool, cp: int = 1, cp_rank: int = 0):
    """Logits of this rank, loss and {name: (weight, grad, split dim, summed over tp)}, on this
    cp rank's zigzag shard of the batch."""
    tokens, targets = batch()
    documents = documents_of(tokens, 0).shard(cp, cp_rank) if document_mask else None
    tokens, targets = (shard_sequence(x, cp, cp_rank) for x in (tokens, targets))
    logits = model(tokens, documents)
    loss = mean_cross_entropy(logits, targets, None, model.ps, model.backend)
    loss.backward()
    return logits.detach(), float(loss.detach()), {
        name: (p.detach().clone(), p.grad.clone(), role(p).tp_split_dim,
               role(p).sequence_parallel_grad)
        for name, p in model.named_parameters()
    }  # fmt: skip


def _tp_worker(rank, world, sequence_parallel, document_mask):
    cfg = hybrid_config(world, 12, f"parallel.sequence_parallel={sequence_parallel}")
    model = GPT(cfg, derive(cfg, world), ParallelState.from_world(tp=world, dp=1))
    return run_model(model, document_mask)


@functools.cache
def tp1(document_mask: bool, dtype: torch.dtype = torch.float32, kernel: int = KERNEL):
    cfg = hybrid_config(1, 12, f"model.linear_conv_kernel_dim={kernel}")
    model = GPT(cfg, derive(cfg, 1), ParallelState.single()).to(dtype)
    return run_model(model, document_mask)


def assert_equals_tp1(results: list, document_mask: bool, kernel: int = KERNEL) -> None:
    """results: each tp rank's (logits, loss, params) as run_model gives them (a whole
    sequence's) equal tp 1's: weights bit for bit, logits, loss and every gradient."""
    ref_logits, ref_loss, ref_params = tp1(document_mask, torch.float32, kernel)
    logits = torch.cat([r[0] for r in results], dim=-1)[..., :VOCAB]
    assert rel_err(logits, ref_logits[..., :VOCAB]) < FP32_REORDER
    assert abs(results[0][1] - ref_loss) < FP32_REORDER * ref_loss
    for name, (ref_weight, ref_grad, _, _) in ref_params.items():
        split, summed = results[0][2][name][2:]
        shards = [[r[2][name][i] for r in results] for i in (0, 1)]
        weight, grad = (t[0] if split is None else torch.cat(t, dim=split) for t in shards)
        if summed:  # replicated, each rank's gradient covering its tokens or heads
            grad = sum(shards[1])
        if name.endswith(("tok_emb.weight", "lm_head.weight")):
            weight, grad, ref_weight, ref_grad = (t[:VOCAB] for t in (weight, grad, ref_weight,
                                                                      ref_grad))  # fmt: skip
        assert torch.equal(weight, ref_weight), f"{name}: init differs"
        # The decay's gradients (A_log, dt_bias, in_proj_a) sum the rule's dg, a reverse
        # cumulative sum whose terms far exceed it (~1e-9 here): the rule's reordering bound,
        # or, where tp 1's fp32 gradient is further from its fp64 one (the judge's own noise),
        # a few times that noise.
        decay = name.endswith(("A_log", "dt_bias", "in_proj_a.weight"))
        fp64 = tp1(document_mask, torch.float64, kernel)[2][name][1][: ref_grad.shape[0]]
        noise = rel_err(ref_grad, fp64.float())
        bound = max(GATED_DELTA_REL if decay else FP32_REORDER, 4 * noise)
        assert rel_err(grad, ref_grad) < bound, name


@pytest.mark.parametrize(
    "sequence_parallel, document_mask", [(False, False), (True, False), (True, True)]
)
def test_hybrid_model_at_tp2_equals_tp1_weights_logits_loss_and_every_gradient(
    sequence_parallel, document_mask
):
    results = run_on_ranks(_tp_worker, 2, sequence_parallel, document_mask, timeout=180)
    assert_equals_tp1(results, document_mask)


def _cp_worker(rank, world, tp, document_mask, kernel):
    cp = world // tp
    sets = [f"parallel.cp={cp}", f"parallel.sequence_parallel={tp > 1}"]
    sets.append(f"model.linear_conv_kernel_dim={kernel}")
    cfg = hybrid_config(tp, 12, *sets)
    model = GPT(cfg, derive(cfg, world), ParallelState.from_world(tp=tp, dp=1, cp=cp))
    with CommCounter() as counter:
        result = run_model(model, document_mask, cp, rank // tp)
    return (*result, counter.payload_bytes["cp_state"])


def cp_state_bytes(tp: int, cp: int, cp_rank: int, kernel: int, batch_size: int = 3) -> int:
    """The bytes a rank sends per linear layer, forward and backward, to pass the state
    (batch x its value heads x d_k x d_v fp32) and the convolution tail (batch x its channels x
    K - 1, fp32 here) to its neighbours in sequence order: one each way per neighbour."""
    state = batch_size * VALUE_HEADS // tp * KEY_DIM * VALUE_DIM * 4
    channels = KEY_HEADS * 2 * KEY_DIM + VALUE_HEADS * VALUE_DIM
    tail = batch_size * channels // tp * (kernel - 1) * 4
    neighbours = (cp_rank > 0) + (cp_rank < cp - 1)
    return 2 * neighbours * (state + tail)


def cp_joined(results: list, tp: int) -> list:
    """Each tp rank's (logits, loss, params) over the whole sequence from the cp ranks' (global
    rank cp_rank * tp + tp_rank): logits unsharded, the loss and the gradients averaged (the
    cp group's mean is the whole sequence's, as training averages them)."""
    joined = []
    for tp_rank in range(tp):
        ranks = results[tp_rank::tp]
        logits = unshard_sequence([r[0] for r in ranks], dim=1)
        loss = sum(r[1] for r in ranks) / len(ranks)
        params = {
            name: (weight, sum(r[2][name][1] for r in ranks) / len(ranks), *rest)
            for name, (weight, _, *rest) in ranks[0][2].items()
        }
        joined.append((logits, loss, params))
    return joined


@pytest.mark.parametrize(
    "tp, cp, kernel, document_mask",
    # cp 3 has a rank between two others, its pieces of 2 tokens as long as the kernel's tail
    [(1, 2, KERNEL, False), (1, 2, KERNEL, True), (2, 2, KERNEL, False), (2, 2, KERNEL, True),
     (1, 3, 3, True)],
)  # fmt: skip
def test_hybrid_model_at_cp_passes_the_state_and_equals_tp1_logits_loss_and_every_gradient(
    tp, cp, kernel, document_mask
):
    results = run_on_ranks(_cp_worker, cp * tp, tp, document_mask, kernel, timeout=180)
    assert_equals_tp1(cp_joined(results, tp), document_mask, kernel)
    linear_layers = 3
    for rank, result in enumerate(results):
        assert result[3] == linear_layers * cp_state_bytes(tp, cp, rank // tp, kernel), rank
    # check and plan count the busiest rank's, one micro-batch of the same 3 sequences a step
    sets = [f"parallel.cp={cp}", f"parallel.sequence_parallel={tp > 1}"]
    sets += [f"model.linear_conv_kernel_dim={kernel}", "train.micro_batch_size=3"]
    cfg = hybrid_config(tp, 12, *sets, "train.global_batch_size=3")
    formula = formula_payload_by_kind(cfg, derive(cfg, cp * tp))["cp_state"]
    assert formula == max(result[3] for result in results)


def cli_args(out, *sets: str) -> list[str]:
    sizes = ["model.max_seq_len=32", "train.seq_len=32", "train.micro_batch_size=2"]
    sizes += ["train.global_batch_size=4", "train.steps=4", "train.log_every=1"]
    sizes += ["train.eval_every=0", f"run.out_dir={out}", "checkpoint.save=false"]
    return ["--config", str(CONFIGS / "tiny.yaml")] + [
        a for s in HYBRID + sizes + list(sets) for a in ("--set", s)
    ]


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory) -> Path:
    """The run directory of the hybrid's CLI run at tp 1 (its checkpoint in ckpt/), trained once
    for the layouts' tests and the export's."""
    out = tmp_path_factory.mktemp("hybrid") / "tp1"
    saved = ["checkpoint.save=true", f"checkpoint.dir={out / 'ckpt'}"]
    result = invoke_cli("train", *cli_args(out, *saved))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def tp1_losses(tp1_run: Path) -> list[float]:
    return [x["loss"] for x in read_metrics(tp1_run)[0]]


def test_export_of_a_hybrid_llama_checkpoint_is_exit_2_in_one_line(tp1_run, tmp_path):
    out = tmp_path / "hf"
    args = ["--checkpoint", str(tp1_run / "ckpt"), "--format", "hf", "--output", str(out)]
    result = invoke_cli("export", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "model.layer_types" in lines[0] and "qwen3_5" in lines[0], lines[0]
    assert not out.exists()


LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2 sp selective": [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "train.activation_checkpointing=selective",
    ],
    "pp2": ["parallel.pp=2"],
    "dp2 zero3": ["parallel.dp=2", "optim.zero=3"],
    "cp2": ["parallel.cp=2"],
    "cp2 selective": ["parallel.cp=2", "train.activation_checkpointing=selective"],
    "cp2 full": ["parallel.cp=2", "train.activation_checkpointing=full"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_model_trains_from_the_cli_with_the_losses_of_tp1_at_two_ranks(
    tmp_path, layout, tp1_losses
):
    ranks = run_cli_on_ranks(["train", *cli_args(tmp_path / "run", *LAYOUTS[layout])], 2)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
    losses = [x["loss"] for x in read_metrics(tmp_path / "run")[0]]
    assert len(losses) == len(tp1_losses) == 4
    for a, b in zip(losses, tp1_losses):
        assert abs(a - b) <= LAYOUT_CURVE_REL * b, (losses, tp1_losses)
    assert tp1_losses[-1] < tp1_losses[0], "the model learns"


@pytest.mark.parametrize(
    "sets, needles",
    [
        (["parallel.tp=2", "model.linear_num_key_heads=3", "model.linear_num_value_heads=6"],
         ["model.linear_num_key_heads: 3 is not divisible by parallel.tp=2", "valid tp: 1"]),
        (["model.linear_num_value_heads=3"], ["model.linear_num_value_heads: 3", "multiple"]),
        (["model.layer_types=[linear_attention, mamba, full_attention, full_attention]"],
         ["model.layer_types[1]: 'mamba' is not valid", "linear_attention | full_attention"]),
        (["model.layer_types=[linear_attention, full_attention]"],
         ["model.layer_types: 2 entries", "model.n_layer=4"]),
        (["model.layer_types=linear_attention"],
         ["model.layer_types: 'linear_attention' is not a list of linear_attention | full"]),
        (["model.linear_conv_kernel_dim=0"], ["model.linear_conv_kernel_dim: 0", ">= 1"]),
        (["parallel.cp=2", "train.seq_len=8"],
         ["parallel.cp: 2 cuts train.seq_len=8 into chunks of 2 tokens", "linear_conv_kernel_dim",
          "valid: a train.seq_len of at least 12"]),
    ],
)  # fmt: skip
def test_a_bad_linear_attention_setting_is_exit_2_with_one_line_naming_the_key(sets, needles):
    args = cli_args("unused") + [a for s in sets for a in ("--set", s)]
    result = invoke_cli("check", *args, "--world-size", "4")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def decode(rank: int, world: int):
    """(full-forward logits, cached-decode logits, the first block's cache shapes) of the
    hybrid at tp = world: a 7-token prompt, then one token at a time."""
    cfg = hybrid_config(world, 12)
    ps = ParallelState.from_world(tp=world, dp=1) if world > 1 else ParallelState.single()
    model = GPT(cfg, derive(cfg, world), ps).eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens)
        cache: list = []
        steps = [decode_step(model, tokens[:, :7], cache, 0)]
        steps += [decode_step(model, tokens[:, i : i + 1], cache, i) for i in range(7, 12)]
    return full, torch.cat(steps, dim=1), [tuple(t.shape) for t in cache[0]]


def test_cached_decode_holds_a_fixed_size_state_and_equals_the_full_forward_at_tp1_and_tp2():
    full, decoded, shapes = decode(0, 1)
    channels = KEY_HEADS * 2 * KEY_DIM + VALUE_HEADS * VALUE_DIM
    assert shapes == [(2, channels, KERNEL - 1), (2, VALUE_HEADS, KEY_DIM, VALUE_DIM)]
    assert rel_err(decoded[..., :VOCAB], full[..., :VOCAB]) < FP32_REORDER
    ranks = run_on_ranks(decode, 2, timeout=180)
    assert ranks[0][2] == [
        (2, channels // 2, KERNEL - 1),
        (2, VALUE_HEADS // 2, KEY_DIM, VALUE_DIM),
    ]
    decoded_tp2 = torch.cat([r[1] for r in ranks], dim=-1)[..., :VOCAB]
    assert rel_err(decoded_tp2, full[..., :VOCAB]) < FP32_REORDER


def test_check_counts_the_linear_attention_blocks_as_their_own_kind():
    result = invoke_cli("check", *cli_args("unused"))
    assert result.returncode == 0, result.stderr
    assert "linear_attention blocks as full attention" not in result.stdout
    state = VALUE_HEADS * KEY_DIM * VALUE_DIM * 4  # fp32, and the bf16 tail of K - 1 inputs
    tail = (KERNEL - 1) * (KEY_HEADS * 2 * KEY_DIM + VALUE_HEADS * VALUE_DIM) * 2
    assert f"fixed per sequence {3 * (state + tail):,} bytes (state and" in result.stdout


def test_layer_types_read_from_a_config_file_choose_each_blocks_attention(tmp_path):
    config = tmp_path / "hybrid.yaml"
    kinds = "[full_attention, linear_attention, full_attention, linear_attention]"
    config.write_text(f"model:\n  arch: llama\n  n_layer: 4\n  layer_types: {kinds}\n")
    model = load_config(config).model
    assert model.layer_types == ["full_attention", "linear_attention"] * 2
    assert [model.block_attention(i) for i in range(5)] == ["mha", "gated_deltanet"] * 2 + ["mha"]
