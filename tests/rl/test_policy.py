"""The RL backend's Policy on a tiny transformers Llama (checkpoint.init_from_hf): its
log-probabilities equal transformers' log_softmax gathered at the tokens at tp 1, tp 2 with
sequence parallelism (and ZeRO-3 over dp 2), tp 2 x pp 2 and cp 2 (dp 2), and a tiny
Qwen3-MoE's at tp 2 x ep 2 (dp 2), on packed sequences of different lengths, the same on every
rank; its entropies are transformers'; a step's
gradients do not depend on the packing budget, and its loss and gradient norm do not depend
on the layout; the weights it streams are transformers' state_dict() bitwise at each layout
(the MoE's: its file's tensors, experts one by one), under ZeRO-3 gathering about a bucket's
parameters at a time; it streams back what it loads, and an inference model refit at tp 1
from the tp 2 x pp 2 stream gives the tp 1 policy's logits bitwise. The stream comes in
buckets of about bucket_mb. Routing replay: generate records the routes the policy would
choose, and foreign routes forced at tp 2 x ep 2 and pp 2 x ep 2 with recompute give the
training forward the forward-only log-probabilities bitwise. One four-rank run holds every
layout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf.curve import run_settings
from tests.ranks import run_on_ranks
from tests.tolerances import EXACT, RL_GRAD_REL, RL_LOGPROB_ABS

transformers = pytest.importorskip("transformers")

BUCKET_MB = 0.01  # 10486 bytes: the tiny models' embeddings are larger, a block's others smaller
LENGTHS = [5, 17, 9, 12, 3, 20, 8, 22]  # 5 rows at 24 tokens: dp 2 runs a filler
PROMPTS = [2, 6, 4, 1, 2, 10, 3, 7]
LAYOUTS = {  # four ranks each; the model; dp shares out the rows
    "tp2_sp_zero3": ("llama", ["parallel.tp=2", "parallel.sequence_parallel=true", "optim.zero=3"]),
    "tp2_pp2": ("llama", ["parallel.tp=2", "parallel.pp=2"]),
    "cp2": ("llama", ["parallel.cp=2"]),
    "moe_tp2_ep2": ("qwen3_moe", ["parallel.tp=2", "parallel.ep=2"]),
    "moe_pp2_ep2_recompute": (
        "qwen3_moe",
        ["parallel.pp=2", "parallel.ep=2", "train.activation_checkpointing=full"],
    ),
}
MOE = sorted(name for name, (model, _) in LAYOUTS.items() if model == "qwen3_moe")
EXPERTS = 4
DENSE = sorted(name for name, (model, _) in LAYOUTS.items() if model == "llama")
SHAPE = dict(
    vocab_size=101,  # padded at tp 2
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)
MODELS = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig, SHAPE),
    "qwen3_moe": (  # 4 experts, 2 a token
        "Qwen3MoeForCausalLM",
        transformers.Qwen3MoeConfig,
        dict(
            SHAPE,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
        ),
    ),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (GQA 4/2) and a tiny Qwen3-MoE, every weight random, as save_pretrained
    writes them (the MoE's experts one by one, as export writes them too)."""
    paths = {}
    for name, (cls, config_class, keys) in MODELS.items():
        torch.manual_seed(0)
        model = getattr(transformers, cls)(config_class(**keys)).eval()
        with torch.no_grad():
            for param in model.parameters():
                vector = param.dim() == 1
                param.normal_(1.0 if vector else 0.0, 0.2 if vector else 0.15)
        paths[name] = tmp_path_factory.mktemp("rl") / name
        model.save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="module")
def hf_dir(hf_dirs) -> Path:
    return hf_dirs["llama"]


def _seqs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 101, (n,), generator=gen).tolist() for n in LENGTHS]


def _settings(hf_dir: Path, tmp: Path) -> list[str]:
    return run_settings(hf_dir) + [
        "train.seq_len=32",
        "train.micro_batch_size=1",
        "train.grad_clip=0",
        "checkpoint.resume=never",
        f"run.out_dir={tmp}",
        "rl.tokens_per_micro_batch=24",
    ]


def _step_args(seqs):
    gen = torch.Generator().manual_seed(9)
    advantages = torch.randn(len(seqs), generator=gen).tolist()
    return dict(prompt_lens=PROMPTS, advantages=advantages, loss="gspo")


@pytest.fixture(scope="module")
def references(hf_dirs) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Each model's transformers log-probabilities and entropies of each sequence alone."""
    out = {}
    for name, path in hf_dirs.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        logprobs, entropies = [], []
        with torch.no_grad():
            for seq in _seqs():
                logits = model(torch.tensor([seq])).logits[0, :-1].float()
                log_softmax = torch.log_softmax(logits, -1)
                logprobs.append(log_softmax.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0])
                entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))
        out[name] = logprobs, entropies
    return out


@pytest.fixture(scope="module")
def reference(references):
    return references["llama"]


@pytest.fixture(scope="module")
def single(hf_dir, tmp_path_factory) -> dict:
    """At tp 1 in this process: log-probabilities and entropies, the gradients of one step at
    two packing budgets, and that step's metrics."""
    from megatronish.rl import Policy

    policy = Policy(None, _settings(hf_dir, tmp_path_factory.mktemp("run")))
    seqs = _seqs()
    out = {"logprobs": policy.logprobs(seqs), "entropies": policy.entropies(seqs)}
    grads = {}
    for budget in (1, 64):  # one sequence a row; several a row
        policy.cfg.rl.tokens_per_micro_batch = budget
        out[f"metrics_{budget}"] = policy.gradients(seqs, **_step_args(seqs))
        grads[budget] = [p.grad.clone() for p in policy.model.parameters()]
        policy.data_parallel.after_step()
    out["grads"] = grads
    out["policy"] = policy
    return out


@pytest.fixture(scope="module")
def moe_rollouts(hf_dirs, tmp_path_factory) -> dict:
    """Rollouts of the tiny Qwen3-MoE sampled at temperature 1 by generate's engine (tp 1,
    refit from a tp 1 Policy's stream) with their routes recorded, and that Policy's
    log-probabilities of them, replaying the routes and not."""
    from megatronish.distributed.layout import ParallelState
    from megatronish.inference.generate import Generation, Sampling
    from megatronish.inference.model import inference_model, refit
    from megatronish.rl import Policy

    tmp = tmp_path_factory.mktemp("moe")
    policy = Policy(None, _settings(hf_dirs["qwen3_moe"], tmp))
    engine = inference_model(policy.cfg, 101, ParallelState.single(torch.device("cpu")))
    refit(engine, policy.hf_weights())
    seqs, routes = [], []
    for index, (seq, prompt_len) in enumerate(zip(_seqs()[:4], PROMPTS[:4])):
        prompt = seq[: max(prompt_len, 1)]
        allowed = torch.ones(101, dtype=torch.bool)
        generation = Generation(engine, prompt, 6, Sampling(1.0), index, None, allowed, True)
        seqs.append(prompt + list(generation))
        routes.append(generation.routes)
    return dict(
        seqs=seqs,
        routes=routes,
        free=policy.logprobs(seqs),
        replayed=policy.logprobs(seqs, routes),
        policy=policy,
    )


def _replay(policy, rollouts: dict) -> dict:
    """A MoE policy's results on the rollouts with foreign routes (each recorded expert
    shifted by one, so that forcing them changes every token's experts): log-probabilities
    forward only, and a step's metrics with old_logprobs None (the training forward's own)
    and with those log-probabilities, with recompute and without."""
    seqs, prompts = rollouts["seqs"], PROMPTS[: len(rollouts["seqs"])]
    shifted = [(route + 1) % EXPERTS for route in rollouts["routes"]]
    out = {"free": policy.logprobs(seqs), "replayed": policy.logprobs(seqs, shifted)}
    args = dict(prompt_lens=prompts, advantages=[1.0, -0.5, 0.25, -2.0][: len(seqs)])
    for name, old in (("own", None), ("forward_only", out["replayed"])):
        out[name] = policy.gradients(seqs, **args, old_logprobs=old, routes=shifted)
        policy.data_parallel.after_step()
    recompute = policy.model.full_checkpoint
    policy.model.full_checkpoint = False
    out["no_recompute"] = policy.gradients(seqs, **args, routes=shifted)
    policy.data_parallel.after_step()
    policy.model.full_checkpoint = recompute
    return out


def _on_layouts(rank: int, world: int, hf_dirs: dict[str, Path], tmp: Path, rollouts: dict) -> dict:
    from megatronish.distributed import comm
    from megatronish.rl import Policy
    from megatronish.rl.stream import hf_buckets

    out = {}
    seqs = _seqs()
    for name, (model, layout) in LAYOUTS.items():
        hf_dir = hf_dirs[model]
        comm.disable_shared_memory()  # the last layout's groups
        policy = Policy(None, _settings(hf_dir, tmp) + layout)
        out[name] = {
            "logprobs": policy.logprobs(seqs),
            "metrics": policy.gradients(seqs, **_step_args(seqs)),
            "streamed": dict(policy.hf_weights(bucket_mb=BUCKET_MB)),  # several buckets
            "buckets": [
                {name: tensor.nbytes for name, tensor in bucket.items()}
                for bucket in hf_buckets(policy.model, policy.cfg, policy.data_parallel, BUCKET_MB)
            ],
        }
        policy.data_parallel.after_step()
        if "optim.zero=3" in layout:
            out[name]["zero3_held"] = _zero3_held_while_streaming(policy)
        if model == "qwen3_moe":
            out[name]["replay"] = _replay(policy, rollouts)
        halved = {k: v * 0.5 for k, v in load_file(hf_dir / "model.safetensors").items()}
        policy.load_hf_weights(halved.items())
        out[name]["reloaded"] = dict(policy.hf_weights(bucket_mb=BUCKET_MB))
    return out


def _zero3_held_while_streaming(policy) -> dict[str, int]:
    """ZeRO-3's tally of whole parameter bytes held on this rank (its gathered buckets), at its
    peak while the policy streams its weights, with the largest bucket's bytes and all of
    them whole (what holding the stage's whole parameters for the stream would hold)."""
    shards = policy.data_parallel.shards
    start, peak = shards._start, [0]

    def counted(bucket) -> None:
        start(bucket)
        held = sum(b.full.untyped_storage().nbytes() for b in shards.buckets)
        peak[0] = max(peak[0], held)

    shards._start = counted
    try:
        for _ in policy.hf_weights(bucket_mb=BUCKET_MB):
            pass
    finally:
        del shards._start
    sizes = [b.full.numel() * b.full.element_size() for b in shards.buckets]
    return {"peak": peak[0], "largest": max(sizes), "whole": sum(sizes)}


@pytest.fixture(scope="module")
def layouts(hf_dirs, tmp_path_factory, moe_rollouts) -> list[dict]:
    rollouts = {key: moe_rollouts[key] for key in ("seqs", "routes")}
    tmp = tmp_path_factory.mktemp("runs")
    return run_on_ranks(_on_layouts, 4, hf_dirs, tmp, rollouts, timeout=300)


def test_logprobs_at_tp1_equal_transformers_log_softmax_at_the_tokens(single, reference):
    for ours, theirs in zip(single["logprobs"], reference[0], strict=True):
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=EXACT, atol=RL_LOGPROB_ABS)


def test_entropies_equal_transformers_distributions_entropies(single, reference):
    for ours, theirs in zip(single["entropies"], reference[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=EXACT, atol=RL_LOGPROB_ABS)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_at_each_layout_equal_transformers_on_every_rank(layout, layouts, references):
    reference = references[LAYOUTS[layout][0]]
    for rank_results in layouts:
        for ours, theirs in zip(rank_results[layout]["logprobs"], reference[0], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=EXACT, atol=RL_LOGPROB_ABS)


def test_step_gradients_do_not_depend_on_the_packing_budget(single):
    for one, packed in zip(single["grads"][1], single["grads"][64], strict=True):
        scale = one.abs().max().item()
        torch.testing.assert_close(packed, one, rtol=EXACT, atol=RL_GRAD_REL * scale)
    assert single["metrics_64"]["loss"] == pytest.approx(
        single["metrics_1"]["loss"], rel=RL_GRAD_REL
    )


@pytest.mark.parametrize("layout", DENSE)
def test_step_loss_and_grad_norm_at_each_layout_equal_tp1(layout, layouts, single):
    want = single["metrics_64"]
    for rank_results in layouts:
        got = rank_results[layout]["metrics"]
        for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
            assert got[key] == pytest.approx(want[key], rel=RL_GRAD_REL, abs=RL_GRAD_REL), key


@pytest.mark.parametrize("layout", DENSE)
def test_hf_weights_at_each_layout_are_transformers_state_dict_bitwise_on_rank0(
    layout, layouts, hf_dir
):
    want = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    streamed = layouts[0][layout]["streamed"]
    assert sorted(streamed) == sorted(want)
    for name, tensor in want.items():
        assert streamed[name].shape == tensor.shape and torch.equal(streamed[name], tensor), name
    assert all(not rank_results[layout]["streamed"] for rank_results in layouts[1:])


@pytest.mark.parametrize("layout", ["tp2_pp2", "moe_tp2_ep2"])
def test_hf_weights_stream_buckets_of_about_bucket_mb_that_together_are_the_stream(layout, layouts):
    buckets, streamed = layouts[0][layout]["buckets"], layouts[0][layout]["streamed"]
    budget = BUCKET_MB * 2**20
    assert len(buckets) > 2
    for bucket in buckets:  # a tensor larger than the budget is a bucket alone
        assert sum(bucket.values()) <= budget or len(bucket) == 1, bucket
    assert max(sum(b.values()) for b in buckets) < 2 * budget  # the largest tensor: 12928 bytes
    names = [name for bucket in buckets for name in bucket]
    assert sorted(names) == sorted(streamed) and len(names) == len(set(names))
    assert all(not rank_results[layout]["buckets"] for rank_results in layouts[1:])


def test_hf_weights_under_zero3_gathers_about_one_bucket_at_a_time_not_the_whole_model(layouts):
    budget = BUCKET_MB * 2**20 / 2  # a rank's tp half of a bucket's whole tensors
    for rank_results in layouts:
        held = rank_results["tp2_sp_zero3"]["zero3_held"]
        # a bucket's parameters, and the ZeRO buckets (one module's each) that straddle its ends
        assert 0 < held["peak"] <= budget + 2 * held["largest"], held
        assert held["peak"] < held["whole"] / 2, held


def test_hf_weights_of_a_moe_at_tp2_ep2_are_its_files_tensors_bitwise_on_rank0(layouts, hf_dirs):
    want = load_file(hf_dirs["qwen3_moe"] / "model.safetensors")  # transformers fuses experts
    streamed = layouts[0]["moe_tp2_ep2"]["streamed"]
    assert sorted(streamed) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(streamed[name], tensor), name


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_load_hf_weights_at_each_layout_streams_back_what_it_loaded(layout, layouts, hf_dirs):
    hf_dir = hf_dirs[LAYOUTS[layout][0]]
    halved = {k: v * 0.5 for k, v in load_file(hf_dir / "model.safetensors").items()}
    reloaded = layouts[0][layout]["reloaded"]
    assert sorted(reloaded) == sorted(halved)
    for name, tensor in halved.items():
        assert torch.equal(reloaded[name], tensor), name


def test_refit_at_tp1_from_the_tp2_pp2_stream_gives_the_tp1_policys_logits_bitwise(layouts, single):
    from megatronish.distributed.layout import ParallelState
    from megatronish.inference.model import inference_model, refit

    policy = single["policy"]
    engine = inference_model(
        policy.cfg, policy.derived.vocab_size, ParallelState.single(torch.device("cpu"))
    )
    refit(engine, layouts[0]["tp2_pp2"]["streamed"].items())
    tokens = torch.tensor(_seqs()[:1])
    with torch.no_grad():
        assert torch.equal(engine(tokens), policy.model(tokens))


def test_generate_records_the_routes_the_policy_would_choose(moe_rollouts):
    for seq, route in zip(moe_rollouts["seqs"], moe_rollouts["routes"], strict=True):
        assert route.shape == (2, len(seq) - 1, 2)  # 2 MoE layers, the last token not fed
    for ours, free in zip(moe_rollouts["replayed"], moe_rollouts["free"], strict=True):
        torch.testing.assert_close(ours, free, rtol=EXACT, atol=RL_LOGPROB_ABS)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda r: r[:1], "routes[0]: shape [1, "),
        (lambda r: r[:, :2], "routes[0]: 2 tokens for a 8-token sequence"),
        (lambda r: r + EXPERTS, "routes[0]: an expert outside 0 .. 3"),
    ],
)
def test_routes_that_do_not_fit_are_a_user_error_naming_them(change, named, moe_rollouts):
    from megatronish.errors import UserError

    seqs, routes = moe_rollouts["seqs"], moe_rollouts["routes"]
    with pytest.raises(UserError, match=re.escape(named)):
        moe_rollouts["policy"].logprobs(seqs, [change(routes[0]), *routes[1:]])


@pytest.mark.parametrize("layout", MOE)
def test_routing_replay_forces_the_experts_and_the_training_forward_gives_its_logprobs_bitwise(
    layout, layouts
):
    for rank_results in layouts:
        replay = rank_results[layout]["replay"]
        assert not any(
            torch.equal(a, b) for a, b in zip(replay["replayed"], replay["free"], strict=True)
        )
        # old_logprobs None: the training forward's own; equal metrics (bitwise) mean that
        # forward (train mode, 1F1B, recompute) gave the forward-only logprobs bitwise
        assert replay["forward_only"] == replay["own"]
        assert replay["no_recompute"] == replay["own"]
        assert replay["own"]["clip_fraction"] == 0.0


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda p, s: p.logprobs([[1]]), "seqs[0]: 1 tokens"),
        (lambda p, s: p.logprobs([[1, 101]]), "seqs[0]: a token id outside 0 .. 100"),
        (lambda p, s: p.gradients(s, PROMPTS, [0.0] * len(s), loss="ppo"), "loss: 'ppo'"),
        (lambda p, s: p.gradients(s, PROMPTS[:2], [0.0] * len(s)), "prompt_lens: 2 entries"),
        (lambda p, s: p.gradients(s, PROMPTS, [0.0] * len(s), kl_coef=0.1), "ref_logprobs"),
        (
            lambda p, s: p.gradients(s, PROMPTS, [0.0] * len(s), old_logprobs=[[0.0]] * len(s)),
            "old_logprobs[0]: 1 values",
        ),
        (
            lambda p, s: p.logprobs(s, routes=[torch.zeros(1, 2, 2)] * len(s)),
            "routes: the model has no MoE layers",
        ),
    ],
)
def test_a_bad_argument_is_a_user_error_naming_it_before_any_work(call, named, single):
    from megatronish.errors import UserError

    policy = single["policy"]
    with pytest.raises(UserError, match=re.escape(named)):
        call(policy, _seqs())
    assert all(p.grad is None for p in policy.model.parameters())


def test_a_policy_step_under_muon_with_qk_clip_clips_and_reports_max_attn_logit(hf_dir, tmp_path):
    from megatronish.rl import Policy

    tau = ["optim.name=muon", "optim.muon.qk_clip_tau=0.01"]  # under the model's logits
    policy = Policy(None, _settings(hf_dir, tmp_path) + tau)
    attention = policy.model.blocks["0"].attn
    before = attention.qkv.weight.detach().clone()
    seqs = _seqs()
    metrics = policy.step(seqs, **_step_args(seqs))
    assert metrics["max_attn_logit"] > 1.0  # 100 times tau: every head is clipped hard
    # per kv group: 2 query heads, the key, the value; the query and key rows shrank by the
    # root of their heads' tau / max (~0.06 here), far below what one step's update moves
    rows = attention.qkv.weight.view(2, 4, -1).norm(dim=-1)
    was = before.view(2, 4, -1).norm(dim=-1)
    assert (rows[:, :3] < 0.25 * was[:, :3]).all()
    assert (rows[:, 3] > 0.9 * was[:, 3]).all()  # the values are Muon's alone
