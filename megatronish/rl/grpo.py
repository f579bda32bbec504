"""`megatronish rl`: the built-in GRPO run on a verifiable task that needs no download.

The task: "a+b=" with a and b in 0 .. 9, answered by the sum's digits and the end-of-text
token, over a 13-token vocabulary (the digits, "+", "=", end of text). A Policy at the config's
layout is first trained supervised on right answers (rl.sft_steps: the grpo loss with every
advantage 1 and the ratio 1, the mean per-token log-likelihood), then by GRPO for train.steps
steps: each step the policy's weights are streamed in memory into generate's engine (tp 1, on
rank 0), which samples rl.num_generations completions of each of rl.prompts_per_step prompts at
rl.temperature, sent to every rank; the reward is 1 for a right answer ended by end of text, else 0;
advantages are the rewards less their group's mean over its standard deviation (+ 1e-4), and
the policy takes one grpo step. metrics.jsonl (rank 0) logs each step's mean `reward`, and the
step's loss, clip_fraction, kl, entropy and grad_norm.
"""

from __future__ import annotations

import collections
import contextlib
import random
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatronish.config import Config, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.inference.generate import Generation, Sampling
from megatronish.inference.model import inference_model, refit
from megatronish.rl.policy import Policy
from megatronish.training.metrics import MetricsWriter

SYMBOLS = "0123456789+="
EOT = len(SYMBOLS)  # the end-of-text token
VOCAB = EOT + 1
GROUP_STD_EPS = 1e-4  # trl's epsilon of the group-normalized advantages


def problem(rng: random.Random) -> tuple[list[int], list[int]]:
    """(prompt "a+b=", the right completion: the sum's digits, then end of text)."""
    a, b = rng.randrange(10), rng.randrange(10)
    return _ids(f"{a}+{b}="), _ids(str(a + b)) + [EOT]


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """Each reward less its group's mean, over the group's standard deviation (+ eps)."""
    values = torch.tensor(rewards, dtype=torch.float64).view(-1, group)
    mean, std = values.mean(1, keepdim=True), values.std(1, keepdim=True)
    return ((values - mean) / (std + GROUP_STD_EPS)).flatten().tolist()


def run_rl(config_path: str | None, overrides: list[str]) -> None:
    """The run: SFT, then GRPO, metrics to <run.out_dir>/metrics.jsonl."""
    try:
        check_rl(load_config(config_path, overrides))
    except UserError as exc:  # the same on every rank of a torchrun: said once, by rank 0
        exc.rank0_prints = True
        raise
    with _one_thread():
        policy = Policy(config_path, overrides)
        cfg, ps = policy.cfg, policy.ps
        rng = random.Random(cfg.train.seed)
        writer = MetricsWriter(Path(cfg.run.out_dir), ps.is_main)
        try:
            for _ in range(cfg.rl.sft_steps):
                problems = [problem(rng) for _ in range(cfg.rl.prompts_per_step)]
                seqs = [prompt + answer for prompt, answer in problems]
                prompt_lens = [len(prompt) for prompt, _ in problems]
                policy.step(seqs, prompt_lens, [1.0] * len(seqs), lr=cfg.rl.sft_lr)
            engine = _engine_on_rank_0(cfg, ps)
            for step in range(1, cfg.train.steps + 1):
                _refit_on_rank_0(policy, engine)
                seqs, prompt_lens, rewards = _from_rank_0(ps, _rollouts, engine, cfg, rng, step)
                advantages = group_advantages(rewards, cfg.rl.num_generations)
                metrics = policy.step(seqs, prompt_lens, advantages, loss="grpo")
                writer.write({"step": step, "reward": sum(rewards) / len(rewards), **metrics})
        finally:
            writer.close()


@contextlib.contextmanager
def _one_thread():
    """torch on one CPU thread for the run: the task's model is tiny, so its ops are too small
    to share among threads, and the threads' OpenMP barriers spin whenever another process
    holds a core (on a loaded 2-core host a step took 40 times as long on two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _rollouts(engine, cfg, rng: random.Random, step: int) -> tuple[list, list, list]:
    """(sequences, prompt lengths, rewards) of one step: num_generations samples a prompt."""
    seqs, prompt_lens, rewards = [], [], []
    sampling, allowed = Sampling(cfg.rl.temperature), torch.ones(VOCAB, dtype=torch.bool)
    for index in range(cfg.rl.prompts_per_step):
        prompt, answer = problem(rng)
        for sample in range(cfg.rl.num_generations):
            seed = cfg.train.seed + (step * cfg.rl.prompts_per_step + index) * 1000 + sample
            generation = Generation(
                engine, prompt, cfg.rl.max_completion_length, sampling, seed, EOT, allowed
            )
            completion = list(generation)
            ended = generation.stop_reason == "eot"
            completion += [EOT] if ended else []
            seqs.append(prompt + completion)
            prompt_lens.append(len(prompt))
            rewards.append(1.0 if completion == answer else 0.0)
    return seqs, prompt_lens, rewards


def _engine_on_rank_0(cfg, ps: ParallelState):
    """Generate's engine at tp 1 on rank 0 (None on the others), its layers on a process group
    of rank 0 alone (an initialized world would otherwise be their default group)."""
    alone = dist.new_group([0]) if ps.world_size > 1 else None  # collective: every rank
    if not ps.is_main:
        return None
    return inference_model(cfg, VOCAB, replace(ParallelState.single(ps.device), tp_group=alone))


def _refit_on_rank_0(policy: Policy, engine) -> None:
    """The policy's weights streamed into rank 0's engine, in memory (every rank iterates the
    stream: its gathering is collective; rank 0's yields them)."""
    pairs = policy.hf_weights()
    if engine is not None:
        refit(engine, pairs)
    else:
        collections.deque(pairs, maxlen=0)


def _from_rank_0(ps: ParallelState, sample, *args) -> tuple:
    """sample(*args) on rank 0 (the only rank that holds the streamed weights), sent to every
    rank: the policy's step takes the same rollouts on each."""
    box = [sample(*args) if ps.is_main else None]
    if ps.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def check_rl(cfg: Config) -> None:
    """UserError naming the first setting of cfg that the built-in run cannot take."""
    rl = cfg.rl
    if cfg.model.vocab_size != VOCAB:
        raise UserError(f"model.vocab_size: {cfg.model.vocab_size}; the addition task has {VOCAB}")
    if rl.num_generations < 2:
        raise UserError(f"rl.num_generations: {rl.num_generations}; a group needs 2 or more")
    if rl.prompts_per_step < 1 or rl.max_completion_length < 1 or rl.sft_steps < 0:
        raise UserError(
            "rl.prompts_per_step and rl.max_completion_length must be >= 1, rl.sft_steps >= 0"
        )
    if not rl.temperature > 0:
        raise UserError(f"rl.temperature: {rl.temperature}; must be > 0")
    if rl.sft_lr is not None and not rl.sft_lr > 0:
        raise UserError(f"rl.sft_lr: {rl.sft_lr}; must be > 0 (or null: train.lr)")


def _ids(text: str) -> list[int]:
    return [SYMBOLS.index(char) for char in text]
