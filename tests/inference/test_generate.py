"""Generation: the KV-cached decoding path computes what the full forward does (with RoPE
scaling, under a sliding window shorter and longer than the prompt, and with multi-head latent
attention's latent cache), greedy generation is the same at tp = 1 and tp = 2, sampling is
seeded, only ids the tokenizer decodes are drawn (a padded vocabulary's others never), and the
CLI streams text and says the decode cache's bytes per token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from click.testing import CliRunner

from megatronish.checkpoint.reader import Checkpoint
from megatronish.cli import cli
from megatronish.data import ByteTokenizer
from megatronish.distributed.layout import ParallelState
from megatronish.inference.decode import decode_step
from megatronish.inference.generate import (
    Generation,
    Sampling,
    StreamDecoder,
    decodable_mask,
    next_token,
)
from megatronish.inference.model import build_model
from tests.checkpoints import VOCAB, save_single, tiny_cfg, tokens
from tests.conftest import invoke_cli
from tests.ranks import run_on_ranks
from tests.tolerances import BEYOND_ROUNDING, EXACT, FP32_DECODE_ABS

GREEDY = Sampling(temperature=0.0)
# Multi-head latent attention (with the deepseek_v3 preset's YaRN scaling): the cache holds a
# latent of 16 and a rotary key of 8 per token, not 4 heads of keys (16 + 8) and values (12).
MLA = [
    "model.mla.q_lora_rank=24",
    "model.mla.kv_lora_rank=16",
    "model.mla.qk_nope_head_dim=16",
    "model.mla.qk_rope_head_dim=8",
    "model.mla.v_head_dim=12",
]
PROMPT = [104, 101, 108, 108, 111]  # "hello"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    paths = {arch: save_single(root / arch, tiny_cfg(arch))[0] for arch in ("gpt2", "llama")}
    # Heads of 24 on d_model 64: the cache holds [b, n_kv, s, 24]; and yarn RoPE scaling, saved
    # with the checkpoint's config (the cached path rotates by the same scaled table).
    yarn = "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 16}"
    head_dim = tiny_cfg("llama", "model.head_dim=24", yarn)
    paths["llama_head_dim"] = save_single(root / "hd", head_dim)[0]
    paths["mla"] = save_single(root / "mla", tiny_cfg("deepseek_v3", *MLA))[0]
    # Qwen3.5's gated attention: each head's gate beside its query (split over tp with it),
    # RoPE on 4 of each head's 16 dims, and zero-centered norms.
    paths["qwen3_5"] = save_single(
        root / "q35", tiny_cfg("qwen3_5", "model.head_dim=16", "model.n_kv_head=2")
    )[0]
    # Qwen3.5's hybrid: a Gated DeltaNet block (2 key heads of 8, 4 value heads of 8, kernel 4)
    # before the gated attention block.
    hybrid = ["model.head_dim=16", "model.n_kv_head=2"]
    hybrid += ["model.layer_types=[linear_attention, full_attention]"]
    hybrid += [f"model.linear_{name}={n}" for name, n in LINEAR_SIZES.items()]
    paths["qwen3_5_hybrid"] = save_single(root / "hybrid", tiny_cfg("qwen3_5", *hybrid))[0]
    return paths


LINEAR_SIZES = {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 8, "value_head_dim": 8}


def generate(model, max_new: int, sampling: Sampling = GREEDY, seed: int = 0, eot=None):
    generation = Generation(
        model, PROMPT, max_new, sampling, seed, eot, decodable_mask(ByteTokenizer(), VOCAB)
    )
    return list(generation), generation.stop_reason


def _cached_and_full(model, sequence):
    """(logits of a 7-token prompt then one token at a time through the cache, logits of the
    full forward, the cache)."""
    with torch.no_grad():
        full = model(sequence)
        cache: list = []
        pieces = [decode_step(model, sequence[:, :7], cache, 0)]
        for pos in range(7, sequence.shape[1]):
            pieces.append(decode_step(model, sequence[:, pos : pos + 1], cache, pos))
    return torch.cat(pieces, dim=1), full, cache


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama_head_dim", "qwen3_5"])
def test_cached_decoding_gives_the_logits_of_the_full_forward(checkpoints, arch):
    model = build_model(Checkpoint(checkpoints[arch]), ParallelState.single())
    cached, full, cache = _cached_and_full(model, tokens(2, 24, seed=3))
    assert len(cache) == 2 and cache[0][0].shape[2] == 24
    assert cache[0][0].shape[3] == (24 if arch == "llama_head_dim" else 16)  # the head dim
    torch.testing.assert_close(cached, full, rtol=EXACT, atol=FP32_DECODE_ABS)


def test_mla_decoding_caches_the_latent_and_rotary_key_and_gives_the_full_forwards_logits(
    checkpoints,
):
    model = build_model(Checkpoint(checkpoints["mla"]), ParallelState.single())
    cached, full, cache = _cached_and_full(model, tokens(2, 24, seed=3))
    assert [[tuple(t.shape) for t in layer] for layer in cache] == [[(2, 24, 16), (2, 24, 8)]] * 2
    torch.testing.assert_close(cached, full, rtol=EXACT, atol=FP32_DECODE_ABS)


@pytest.mark.parametrize("window", [5, 12])  # shorter and longer than the 7-token prompt
def test_cached_decoding_under_a_sliding_window_gives_the_logits_of_the_full_forward(
    checkpoints, window
):
    ckpt = Checkpoint(checkpoints["llama"])  # its weights, the window in the second block
    cfg = ckpt.config
    sliding = dict(sliding_window=window, full_attention_layers=1)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **sliding))
    model = build_model(ckpt, ParallelState.single(), cfg)
    sequence = tokens(2, 24, seed=3)
    cached, full, _ = _cached_and_full(model, sequence)
    torch.testing.assert_close(cached, full, rtol=EXACT, atol=FP32_DECODE_ABS)
    for block in model.blocks.values():  # the same weights without the window
        block.attn.window = None
    with torch.no_grad():
        unwindowed = model(sequence)
    torch.testing.assert_close(
        unwindowed[:, :window], full[:, :window], rtol=EXACT, atol=FP32_DECODE_ABS
    )
    later = (unwindowed[:, window:, :VOCAB] - full[:, window:, :VOCAB]).abs().max()
    assert later > BEYOND_ROUNDING


def _greedy_at_tp2(rank: int, world: int, paths: dict) -> dict:
    ps = ParallelState.from_world(2, 1)
    return {arch: generate(build_model(Checkpoint(p), ps), 20)[0] for arch, p in paths.items()}


def test_greedy_generation_is_the_same_at_tp1_and_tp2(checkpoints):
    at_tp1 = {
        arch: generate(build_model(Checkpoint(path), ParallelState.single()), 20)[0]
        for arch, path in checkpoints.items()
    }
    at_tp2 = run_on_ranks(_greedy_at_tp2, 2, checkpoints, timeout=120)
    assert at_tp2[0] == at_tp2[1] == at_tp1
    # and the cache changes nothing: the argmax of the full forward, token by token
    for arch in ("gpt2", "mla"):
        model = build_model(Checkpoint(checkpoints[arch]), ParallelState.single())
        sequence = list(PROMPT)
        with torch.no_grad():
            for _ in range(20):
                sequence.append(int(model(torch.tensor([sequence]))[0, -1, :VOCAB].argmax()))
        assert sequence[len(PROMPT) :] == at_tp1[arch], arch


@pytest.mark.slow  # several generate subprocesses
def test_sampling_is_seeded_and_top_k_1_or_a_tiny_top_p_is_greedy(checkpoints):
    model = build_model(Checkpoint(checkpoints["llama"]), ParallelState.single())
    greedy, _ = generate(model, 15)
    hot = Sampling(temperature=1.5)
    assert generate(model, 15, hot, seed=1) == generate(model, 15, hot, seed=1)
    assert generate(model, 15, hot, seed=1)[0] != generate(model, 15, hot, seed=2)[0]
    assert generate(model, 15, Sampling(1.5, top_k=1), seed=3)[0] == greedy
    assert generate(model, 15, Sampling(1.5, top_p=1e-6), seed=3)[0] == greedy


def test_top_p_samples_only_from_the_smallest_set_that_reaches_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    gen = torch.Generator().manual_seed(0)
    drawn = {next_token(logits, Sampling(1.0, top_p=0.7), gen) for _ in range(300)}
    assert drawn == {0, 1}
    drawn = {next_token(logits, Sampling(1.0, top_k=3), gen) for _ in range(300)}
    assert drawn == {0, 1, 2}


PADDED = 300  # a model vocabulary past the byte tokenizer's 257, as an import's or a padded one
SAMPLINGS = [GREEDY, Sampling(1.0), Sampling(1.0, top_k=40), Sampling(1.0, top_p=0.95)]


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A model of 300 ids trained on byte data (the checkpoint records the byte tokenizer)."""
    cfg = tiny_cfg("llama", f"model.vocab_size={PADDED}")
    return save_single(tmp_path_factory.mktemp("padded"), cfg)[0]


def test_a_padded_vocabulary_samples_only_ids_the_tokenizer_decodes(padded):
    model = build_model(Checkpoint(padded), ParallelState.single())
    with torch.no_grad():  # ids 257 and 258 outscore every byte, whatever the hidden state
        direction = torch.randn(64, generator=torch.Generator().manual_seed(0))
        model.lm_head.weight[VOCAB : VOCAB + 2] = torch.stack([direction, -direction]) * 1e3
    decodable = decodable_mask(ByteTokenizer(), PADDED)
    assert decodable.tolist() == [True] * VOCAB + [False] * (PADDED - VOCAB)
    everything = torch.ones(PADDED, dtype=torch.bool)
    for sampling in SAMPLINGS:
        for seed in range(3):
            unmasked = list(Generation(model, PROMPT, 12, sampling, seed, None, everything))
            assert max(unmasked) >= VOCAB  # what a padded id did before: the case is exercised
            drawn = list(Generation(model, PROMPT, 12, sampling, seed, None, decodable))
            assert max(drawn) < VOCAB, (sampling, seed, drawn)


@pytest.mark.parametrize(
    "options",
    [["--seed", "0"], ["--seed", "1"], ["--seed", "2"], ["--temperature", "0"]]
    + [["--top-k", "40", "--seed", "3"], ["--top-p", "0.95", "--seed", "4"]],
)
def test_generate_from_a_padded_vocabulary_prints_only_bytes(padded, options):
    # An id past 256 crashed the byte decoder (the end-of-text id 256 ends the generation).
    args = ["--checkpoint", str(padded), "--prompt", "hello", "--max-new-tokens", "40"]
    result = invoke_cli("generate", *args, *options)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("hello") and "Traceback" not in result.stderr


def test_generation_stops_at_max_seq_len_and_at_the_end_of_text(checkpoints):
    model = build_model(Checkpoint(checkpoints["gpt2"]), ParallelState.single())
    produced, reason = generate(model, 500)
    assert reason == "max_seq_len" and len(PROMPT) + len(produced) == 64
    full, reason = generate(model, 8)
    assert reason == "max_new_tokens" and len(full) == 8
    stop_at = full[3]
    produced, reason = generate(model, 8, eot=stop_at)
    assert reason == "eot" and produced == full[: full.index(stop_at)]


def test_byte_streams_print_multibyte_characters_once_complete():
    decoder = StreamDecoder(ByteTokenizer())
    pieces = [decoder.push(b) for b in "aé€".encode()]
    assert pieces == ["a", "", "é", "", "", "€"]
    assert decoder.push(0xE2) == "" and decoder.flush() == "\ufffd"


def test_generate_command_streams_the_continuation_of_the_prompt(checkpoints):
    args = ["generate", "--checkpoint", str(checkpoints["gpt2"]), "--prompt", "hello"]
    args += ["--max-new-tokens", "12", "--temperature", "0"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    model = build_model(Checkpoint(checkpoints["gpt2"]), ParallelState.single())
    produced, reason = generate(model, 12, eot=256)
    expected = "hello" + ByteTokenizer().decode(produced).replace("\ufffd", "")
    assert result.stdout.replace("\ufffd", "") == expected + "\n"
    # 2 layers of fp32 keys and values of 4 heads of 16
    assert "; decode cache per rank 1,024 bytes per token (512 per layer x 2)]" in result.stderr
    mla = CliRunner().invoke(cli, [*args[:2], str(checkpoints["mla"]), *args[3:]])
    # 2 layers of an fp32 latent of 16 and rotary key of 8 (keys and values: 4 x (24 + 12))
    assert "decode cache per rank 192 bytes per token (96 per layer x 2)]" in mla.stderr
    hybrid = CliRunner().invoke(cli, [*args[:2], str(checkpoints["qwen3_5_hybrid"]), *args[3:]])
    # The full block's fp32 keys and values of 2 kv heads of 16 per token; the linear block's
    # fp32 state (4 value heads of 8 x 8) and convolution tail (3 x 64 channels), at any length.
    fixed = 4 * (4 * 8 * 8 + 3 * (2 * 2 * 8 + 4 * 8))
    assert f"cache per rank 256 bytes per token (256 per layer x 1) + {fixed:,} bytes fixed" in (
        hybrid.stderr
    ), hybrid.stderr
    bad = CliRunner().invoke(cli, args + ["--top-p", "0"])
    assert bad.exit_code == 2 and "--top-p 0.0: must be in (0, 1]" in bad.stderr


@pytest.mark.parametrize(
    "option, value, valid",
    [
        ("--temperature", "nan", "must be a finite number >= 0"),
        ("--temperature", "inf", "must be a finite number >= 0"),
        ("--temperature", "-inf", "must be a finite number >= 0"),
        ("--temperature", "-0.5", "must be a finite number >= 0"),
        ("--top-p", "nan", "must be in (0, 1]"),
        ("--top-p", "inf", "must be in (0, 1]"),
        ("--top-p", "1.5", "must be in (0, 1]"),
        ("--top-k", "-1", "must be >= 0"),
        ("--max-new-tokens", "-3", "must be >= 0"),
    ],
)
def test_a_sampling_option_out_of_range_exits_2_naming_it_and_what_is_valid(
    tmp_path, option, value, valid
):
    # Checked before the checkpoint is opened: a path that does not exist is never reached.
    args = ["generate", "--checkpoint", str(tmp_path / "nowhere"), "--prompt", "hi"]
    result = invoke_cli(*args, option, value)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option} "), result.stderr
    assert valid in lines[0]
