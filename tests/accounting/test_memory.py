"""The memory estimate against what the model holds and saves: the DeepSeek router's routing
biases are a buffer (experts x fp32 per MoE layer, no gradient, no AdamW state), and under fp8
the plan's activations and autocast weight copies are what the code saves: every recipe keeps
an fp8 GEMM's input in its high precision, as bf16 keeps it, and the fp8 layers' weights get no
bf16 copy; ZeRO-3 at pp 1 gathers what the code keeps from forward to backward."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatronish.accounting.components import attention, gated_deltanet
from megatronish.accounting.memory import activation_bytes_per_layer, estimate
from megatronish.accounting.model_state import fp8_layer_params, model_state_bytes
from megatronish.accounting.parameters import local_layer_params, local_parameter_count
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.model.precision import autocast, fp8_layers, fp8_moe_layers
from megatronish.objectives.registry import sequence_losses
from tests.conftest import CONFIGS
from tests.ranks import run_on_ranks
from tests.tolerances import FP64_REORDER

DEEPSEEK_MOE = [
    "model.moe.num_experts=8", "model.moe.router=sigmoid",
    "model.moe.n_group=4", "model.moe.topk_group=2", "model.moe.bias_update_speed=0.01",
    "model.moe.n_shared_experts=2", "model.moe.first_k_dense=1", "model.n_layer=3",
]  # fmt: skip
S, B, H = 8, 2, 128  # 16 tokens: no activation has a weight's shape


def _config(path: str, sets: list[str]):
    return load_config(CONFIGS / path, ["model.vocab_size=256", *sets])


def _model(cfg):
    derived = derive(cfg, 1)
    ps = ParallelState.single()
    return GPT(cfg, derived, ps), derived


def test_routing_biases_are_a_buffer_apart_from_the_trained_parameters():
    cfg = _config("tiny-moe.yaml", DEEPSEEK_MOE)
    model, derived = _model(cfg)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    biases = [p for p in model.parameters() if not p.requires_grad]
    assert len(biases) == len(derived.moe_layers) == 2  # the first block is dense
    state = model_state_bytes(cfg, derived, 0)
    assert state["buffers"] == sum(p.numel() * p.element_size() for p in biases) == 2 * 8 * 4
    assert local_parameter_count(cfg, derived) == trained
    assert state["weights"] == 4 * trained  # fp32, no bias in them
    plain = _config("tiny-moe.yaml", DEEPSEEK_MOE[:1])  # softmax router
    assert model_state_bytes(plain, derive(plain, 1), 0)["buffers"] == 0
    plan = estimate(cfg, 1, 1)
    assert plan.buffers_gb * 2**30 == 64
    without = dataclasses.replace(plan, buffers_gb=0.0)
    assert (plan.total_gb - without.total_gb) * 2**30 == pytest.approx(64)


@pytest.mark.parametrize("extra", [[], DEEPSEEK_MOE])
def test_fp8_layers_keep_their_two_fp8_casts_not_bf16_copies_and_the_estimate_says_so(extra):
    """An fp8 layer's weight has no bf16 copy; its forward and input-gradient casts (a byte a
    value each, and their scales) are kept for the step (megatronish.fp8.gemm)."""
    from megatronish.fp8 import gemm

    cfg = _config("tiny-moe.yaml", ["train.precision=fp8", *extra])
    model, derived = _model(cfg)
    in_fp8 = sum(p.numel() for layer in fp8_layers(model) for p in layer.parameters())
    in_fp8 += sum(p.numel() for moe in fp8_moe_layers(model) for p in moe.experts.parameters())
    assert in_fp8 == fp8_layer_params(cfg, derived, 0) > 0
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with gemm.weights_fixed():
        with autocast(cfg, torch.device("cpu")):
            loss = sequence_losses(model, tokens, tokens).total
        loss.backward()
        kept = [
            q for casts in gemm._WEIGHT_CASTS.values() for _, made in casts.values() for q in made
        ]
        payload = sum(q.payload.numel() * q.payload.element_size() for q in kept)
        scales = sum(q.scale.numel() * q.scale.element_size() for q in kept)
    assert payload == 2 * in_fp8 and scales < 0.02 * payload
    trained = local_parameter_count(cfg, derived)
    copies = 2 * (trained - in_fp8)  # bf16 autocast's, of the weights outside the fp8 layers
    assert model_state_bytes(cfg, derived, 0)["weights"] == 4 * trained + copies + payload


@functools.cache
def _saved_per_layer(sets: tuple[str, ...]) -> int:
    """Bytes the autograd graph saves for one more llama block (2 blocks less 1), parameters
    left out (what a block saves grows with the tokens; its parameters are held anyway)."""
    saved = []
    for layers in (1, 2):
        sizes = [f"model.d_model={H}", f"model.max_seq_len={S}", f"train.seq_len={S}"]
        cfg = _config("tiny.yaml", [*sizes, f"model.n_layer={layers}", *sets])
        model, _ = _model(cfg)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(tensor, seen=seen):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        tokens = torch.randint(0, 200, (B, S), generator=torch.Generator().manual_seed(0))
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        with hooks, autocast(cfg, torch.device("cpu")):
            sequence_losses(model, tokens, tokens)
        saved.append(sum(n for ptr, n in seen.items() if ptr not in params))
    return saved[1] - saved[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_saves_the_activations_bf16_saves_and_the_plan_says_so(recipe):
    """A bf16 block saves its activations and autocast's bf16 copies of its linear weights
    (2 bytes each); an fp8 block the same activations, no copy."""
    llama = ["model.arch=llama", "model.n_head=4", "model.n_kv_head=2"]
    fp8 = [*llama, "train.precision=fp8", f"train.fp8_recipe={recipe}"]
    cfg = _config("tiny.yaml", [*fp8, f"model.d_model={H}", "model.n_layer=1"])
    per_layer_linears = fp8_layer_params(cfg, derive(cfg, 1), 0)
    assert _saved_per_layer(tuple(fp8)) == _saved_per_layer((*llama, "train.precision=bf16")) - (
        2 * per_layer_linears
    )
    bf16 = _config("tiny.yaml", [*llama, "train.precision=bf16"])
    same = _config("tiny.yaml", fp8)
    assert activation_bytes_per_layer(same, 1, False, "none") == activation_bytes_per_layer(
        bf16, 1, False, "none"
    )


@pytest.mark.parametrize("tie", ["true", "false"])
def test_zero3_gathers_at_pp1_what_the_last_module_keeps_from_forward_to_backward(tie):
    """ZeRO-3 at pp 1 keeps the last module's buckets (data_parallel.param_shards): the
    parameters GPT.forward_param_uses lists for the final norm, that is the output layer, the
    multi-token prediction modules and, untied, the token embedding they read. The estimate's
    gathered bytes beyond ZeRO-2's are two layers (running, prefetched) and those."""
    sets = ["model.arch=llama", "model.mtp_depth=1", f"model.tie_embeddings={tie}"]
    one = _config("tiny.yaml", sets)
    norm_f, kept = GPT(one, derive(one, 1), ParallelState.single()).forward_param_uses()[-1]
    head = sum(p.numel() for p in kept) - sum(p.numel() for p in norm_f.parameters())
    gathered = {}
    for zero in (2, 3):
        cfg = _config("tiny.yaml", [*sets, "parallel.dp=2", f"optim.zero={zero}"])
        gathered[zero] = model_state_bytes(cfg, derive(cfg, 2), 0)["gathered"]
    assert gathered[3] - gathered[2] == 4 * (2 * local_layer_params(one, derive(one, 1)) + head)


QWEN3_5 = ["model.linear_value_head_dim=16", "model.max_seq_len=128"]  # e 32, f 16: told apart
HYBRID_BATCH, HYBRID_SEQ = 3, 100  # two chunks of the rule, the second padded


def _hybrid(tp: int, cp: int, sets: tuple[str, ...]):
    """tiny-qwen3_5 at HYBRID_BATCH sequences of HYBRID_SEQ tokens, tp, cp and sets."""
    parallel = [f"parallel.tp={tp}", f"parallel.cp={cp}"]
    batch = [f"train.micro_batch_size={HYBRID_BATCH}", f"train.global_batch_size={HYBRID_BATCH}"]
    batch.append(f"train.seq_len={HYBRID_SEQ}")
    return _config("tiny-qwen3_5.yaml", [*QWEN3_5, *parallel, *batch, *sets])


def _linear_attention_kept(rank: int, world: int, cp: int, *variants: tuple[str, ...]) -> list:
    """For each variant's settings, the bytes the graph of tiny-qwen3_5's first (Gated
    DeltaNet) block's layer still holds after its forward on one of world tp x cp ranks,
    parameters and autocast's copies of its weights left out (model state)."""
    return [_layer_kept(world // cp, cp, sets) for sets in variants]


def _layer_kept(tp: int, cp: int, sets: tuple[str, ...]) -> int:
    import gc
    import weakref

    cfg = _hybrid(tp, cp, sets)
    one = tp * cp == 1
    ps = ParallelState.single() if one else ParallelState.from_world(tp=tp, dp=1, cp=cp)
    layer = GPT(cfg, derive(cfg, tp * cp), ps).train().blocks["0"].attn
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    linears = [layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_b, layer.in_proj_a, layer.out_proj]
    copied = [m.weight for m in linears if m.plan.recipe is None]
    if not layer.selective_checkpoint:  # else the checkpoint casts it again in backward
        copied.append(layer.conv_weight)
    copied = copied if cfg.train.bf16_autocast else []
    held: list[weakref.ref] = []

    class Saved:
        def __init__(self, tensor):
            self.tensor = tensor
            held.append(weakref.ref(self))

    seq = HYBRID_SEQ // cp // (tp if cfg.parallel.sequence_parallel else 1)
    x = torch.randn(HYBRID_BATCH, seq, cfg.model.d_model, requires_grad=True)
    hooks = torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor)
    with hooks, autocast(cfg, torch.device("cpu")):
        out = layer(x)
    gc.collect()  # what only the discarded final state's graph saved is gone
    storages = {}
    for ref in held:
        if (saved := ref()) is not None:
            storage = saved.tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    del out
    kept = sum(n for ptr, n in storages.items() if ptr not in params)
    return kept - 2 * sum(p.numel() for p in copied)


BF16 = ("train.precision=bf16",)
SP = (*BF16, "parallel.sequence_parallel=true")


@pytest.mark.parametrize(
    "tp,cp,variants",
    [
        (1, 1, [BF16, ("train.precision=fp8",), ("train.precision=fp32",)]),
        (1, 1, [(*BF16, "train.activation_checkpointing=selective")]),
        (2, 1, [BF16, SP]),
        (1, 2, [BF16]),
    ],
    ids=["precisions", "selective", "tp2", "cp2"],
)
def test_a_gated_deltanet_layer_keeps_what_the_estimate_counts(tp, cp, variants):
    """What the linear-attention layer's autograd graph holds after its forward (its input as
    its four projections take it, gathered under sequence parallelism; the projections'
    outputs it reads, the convolution's input and output, q and k after their L2 norms, g and
    beta, the chunked rule's saved tensors, the gated norm, out_proj's input; under selective
    recompute the checkpoint's inputs; under cp the state pass's inputs and states) equals the
    accounting's count, byte for byte (under cp on the busiest rank, the last: the first's
    initial state is the zero state), and the block's estimate adds it to the block's norms,
    MLP and the mask after the layer as it adds them to attention."""
    if tp * cp == 1:
        measured = _linear_attention_kept(0, 1, 1, *variants)
    else:
        measured = run_on_ranks(_linear_attention_kept, tp * cp, cp, *variants)[-1]
    for sets, kept in zip(variants, measured):
        cfg = _hybrid(tp, cp, sets)
        recompute, width = cfg.train.activation_checkpointing, 2 if cfg.train.bf16_autocast else 4
        selective, sp, seq = (
            recompute == "selective",
            cfg.parallel.sequence_parallel,
            HYBRID_SEQ // cp,
        )
        counted = gated_deltanet.kept_bytes(cfg.model, tp, cp, HYBRID_BATCH, seq, width, selective)
        sbh = HYBRID_BATCH * seq * cfg.model.d_model
        assert kept == sbh * width + counted, sets  # the input, whole at any tp
        full = activation_bytes_per_layer(cfg, tp, sp, recompute, 3)
        heads, input_and_mask = attention.activations(cfg.model)[1], attention.WHOLE_ACTIVATIONS
        shared = full - sbh * (heads / tp + input_and_mask / (tp if sp else 1)) * width / 2
        mask = sbh * width / 2 / (tp if sp else 1)
        linear = activation_bytes_per_layer(cfg, tp, sp, recompute, 0)
        assert linear == pytest.approx(shared + kept + mask, rel=FP64_REORDER), sets


def test_fp8_layer_params_of_latent_attention_are_those_its_fp8_layers_hold():
    """Multi-head latent attention's replicated down-projections and latent norms stay out of
    the fp8 layers (megatronish.model.precision.fp8_layers), and out of the count."""
    cfg = _config("tiny-deepseek-v3.yaml", ["train.precision=fp8"])
    model, derived = _model(cfg)
    in_fp8 = sum(p.numel() for layer in fp8_layers(model) for p in layer.parameters())
    in_fp8 += sum(p.numel() for moe in fp8_moe_layers(model) for p in moe.experts.parameters())
    assert fp8_layer_params(cfg, derived, 0) == in_fp8
