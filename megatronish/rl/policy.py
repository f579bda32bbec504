"""The RL training backend's policy: the model at the config's layout (in a torchrun rank or
one process), per-token log-probabilities and entropies of variable-length sequences, and one
optimizer step of a policy-gradient loss on rollouts.

Every rank of the layout calls each method with the same arguments and gets the same results.
Each call packs its sequences into rows of at most rl.tokens_per_micro_batch tokens
(rl.packing) and runs them as the step loop runs micro-batches (through the pipeline under
pp); the rows are shared out over the dp ranks, and the results gathered back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megatronish import ops
from megatronish.config import derive, load_config
from megatronish.data_parallel import data_parallel_for
from megatronish.distributed.layout import default_device, init_distributed, world_size_from_env
from megatronish.errors import UserError
from megatronish.model import GPT
from megatronish.model.precision import autocast
from megatronish.objectives.batch import MicroBatch
from megatronish.optim.optimizer import lr_at
from megatronish.optim.qk_clip import QKClip
from megatronish.pipeline.runner import Pipeline
from megatronish.rl.gather import RowResults
from megatronish.rl.losses import LossSettings
from megatronish.rl.objective import PolicyObjective
from megatronish.rl.packing import pack, row_tensors, shard_row
from megatronish.rl.rollouts import (
    Rollouts,
    check_seqs,
    completion_counts,
    shard_terms,
    weightless,
)
from megatronish.rl.routes import check_routes, routed
from megatronish.rl.weights import hf_weights, load_hf_weights, load_start


class Policy:
    """The policy of an RL run: a GPT at the layout of `config_path` with `overrides`
    ("key=value" as --set takes them), from checkpoint.init_from_hf or the checkpoint that
    checkpoint.resume names (else its seeded init), with the run's optimizer (ZeRO level,
    clipping, train.lr's schedule by step)."""

    def __init__(self, config_path: str | None, overrides: list[str] | tuple[str, ...] = ()):
        cfg = load_config(config_path, list(overrides))
        world = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
        derived = derive(cfg, world)
        ops.check_backend(cfg.kernels.backend, default_device())
        ps = init_distributed(
            derived.tp, derived.dp, cfg.parallel.timeout_s, derived.pp, derived.cp, derived.ep
        )
        self.cfg, self.derived, self.ps = cfg, derived, ps
        torch.manual_seed(cfg.train.seed)
        self.model = GPT(cfg, derived, ps)
        self.data_parallel = data_parallel_for(self.model, cfg, ps)
        self.qk_clip = QKClip(self.model, cfg, ps)  # optim.muon.qk_clip_tau
        self.pipeline = (
            Pipeline(self.model, ps, cfg.parallel.pp_schedule) if derived.pp > 1 else None
        )
        load_start(cfg, derived, ps, self.model, self.data_parallel)
        self.steps = 0  # optimizer steps taken (train.lr's schedule reads it)

    # ---- log-probabilities

    def logprobs(
        self, seqs: list[list[int]], routes: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """log p(seq[t] | seq[:t]) for t >= 1 of each sequence: float32 [len(seq) - 1] each.
        routes (a MoE's routing replay, rl.routes): each sequence's recorded experts, forced."""
        return self._forward_only(seqs, routes)[0]

    def entropies(
        self, seqs: list[list[int]], routes: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The entropy of the model's distribution at each position that has a next token:
        float32 [len(seq) - 1] each."""
        return self._forward_only(seqs, routes)[1]

    def _forward_only(self, seqs: list[list[int]], routes) -> tuple[list, list]:
        self._check(seqs, routes)
        objective = PolicyObjective(self.ps, self.cfg.kernels.backend)
        rows, batch = self._batch(seqs, routes)
        self.model.eval()
        try:
            self._run(batch, objective, forward_only=True)
        finally:
            self.model.train()
        self.data_parallel.after_eval()
        results = RowResults(self.ps, rows, [len(s) for s in seqs])
        return results.per_sequence(objective, batch)

    # ---- the step

    def step(
        self,
        seqs: list[list[int]],
        prompt_lens: list[int],
        advantages: list[float],
        loss: str = "grpo",
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        kl_coef: float = 0.0,
        ref_logprobs: list[torch.Tensor] | None = None,
        old_logprobs: list[torch.Tensor] | None = None,
        max_completion_length: int | None = None,
        routes: list[torch.Tensor] | None = None,
        lr: float | None = None,
    ) -> dict[str, float]:
        """One optimizer step of `loss` (rl.losses: grpo | dr_grpo | dapo | gspo) on these
        rollouts, at lr (default: train.lr's schedule for the policy's step count): the
        gradients of `gradients` with the same arguments, then the update. Returns its
        metrics."""
        metrics = self.gradients(
            seqs,
            prompt_lens,
            advantages,
            loss,
            clip_low,
            clip_high,
            kl_coef,
            ref_logprobs,
            old_logprobs,
            max_completion_length,
            routes,
        )
        self.steps += 1
        self.data_parallel.step(lr_at(self.steps, self.cfg) if lr is None else lr)
        self.data_parallel.after_step()
        self.qk_clip.after_step(applied=True)
        return metrics | self.qk_clip.metrics()

    def gradients(
        self,
        seqs: list[list[int]],
        prompt_lens: list[int],
        advantages: list[float],
        loss: str = "grpo",
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        kl_coef: float = 0.0,
        ref_logprobs: list[torch.Tensor] | None = None,
        old_logprobs: list[torch.Tensor] | None = None,
        max_completion_length: int | None = None,
        routes: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """The gradients of `loss` on these rollouts, accumulated over the packed rows, reduced
        and clipped (train.grad_clip) in the parameters' .grad, without the update. Only
        completion tokens (positions >= prompt_len) count; old_logprobs None takes the
        policy's own (detached: the first ratio is 1); a k3 KL to ref_logprobs when kl_coef > 0;
        dr_grpo divides by max_completion_length (default: the longest completion given);
        routes replay a MoE's routing as logprobs() does.
        Log-probabilities come as logprobs() gives them. Returns loss, clip_fraction, kl (0
        without ref_logprobs), entropy (means over the completion tokens; gspo's clip fraction
        over sequences) and grad_norm (before clipping)."""
        self._check(seqs, routes)
        settings = LossSettings(loss, clip_low, clip_high, kl_coef)
        if kl_coef != 0.0 and ref_logprobs is None:
            raise UserError("ref_logprobs: needed when kl_coef is not 0 (k3 KL to the reference)")
        rollouts = Rollouts(seqs, prompt_lens, advantages, old_logprobs, ref_logprobs)
        counts = completion_counts(seqs, prompt_lens)
        longest = max_completion_length or max(max(counts), 1)
        objective = PolicyObjective(self.ps, self.cfg.kernels.backend, settings)
        rows, batch = self._batch(seqs, routes)
        mine = rows[self.ps.dp_rank :: self.ps.dp]
        for index, micro in enumerate(batch):
            terms = rollouts.terms(mine[index] if index < len(mine) else rows[0], loss, longest)
            if index >= len(mine):  # a filler: runs for the collectives, weighs nothing
                terms = weightless(terms)
            on_device = shard_terms(terms, self.ps.cp, self.ps.cp_rank, self.ps.device)
            objective.terms[id(micro)] = on_device
        self.data_parallel.start_of_step(len(batch))
        self.model.set_moe_loss_scale(1.0 / len(batch))
        self._run(batch, objective, forward_only=False)
        self.data_parallel.after_backward()
        grad_norm = self.data_parallel.clip_grads(self.cfg.train.grad_clip)
        metrics = RowResults(self.ps, rows, [len(s) for s in seqs]).metrics(objective)
        return dict(metrics, grad_norm=grad_norm)

    # ---- weights

    def hf_weights(self, bucket_mb: float = 512.0) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, fp32 CPU tensor) of every weight, bitwise those `megatronish
        export` writes, gathered from this layout over the ranks in rounds of about bucket_mb;
        rank 0 yields them, and every rank must iterate (the gathering is collective)."""
        return hf_weights(self.model, self.cfg, self.data_parallel, bucket_mb)

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads the whole model's (Hugging Face name, tensor) pairs, as hf_weights gives them;
        every rank calls it with the same tensors. The optimizer state is kept."""
        load_hf_weights(self.model, self.data_parallel, tensors)

    # ---- micro-batches

    def _check(self, seqs: list[list[int]], routes: list[torch.Tensor] | None) -> None:
        check_seqs(seqs, self.derived.vocab_size, self.cfg.model.max_seq_len)
        if routes is not None:
            check_routes(routes, seqs, self.cfg)

    def _batch(self, seqs: list[list[int]], routes=None) -> tuple[list, list[MicroBatch]]:
        """(every packed row of seqs, this rank's micro-batches): the micro-batches of this dp
        rank's rows (rows[dp_rank::dp]) as this cp rank's shards (their documents with the
        rows' routes, if any), then as many fillers (row 0 again) as make every dp rank's
        count the same (the gradient reduction and ZeRO-3's gathers are collective per
        micro-batch)."""
        ps = self.ps
        multiple = 2 * ps.cp if ps.cp > 1 else 1
        if self.model.sequence_parallel:
            multiple *= ps.tp
        rows = pack([len(s) for s in seqs], self.cfg.rl.tokens_per_micro_batch, multiple)
        mine = rows[ps.dp_rank :: ps.dp]
        fillers = -(-len(rows) // ps.dp) - len(mine)
        batch = []
        for row in mine + [rows[0]] * fillers:
            tokens, targets, documents = row_tensors(row, seqs, ps.device)
            documents = documents.shard(ps.cp, ps.cp_rank)
            if routes is not None:
                documents = routed(documents, row, routes, ps.cp, ps.cp_rank)
            batch.append(
                MicroBatch(
                    shard_row(tokens, ps.cp, ps.cp_rank),
                    shard_row(targets, ps.cp, ps.cp_rank),
                    documents=documents,
                )
            )
        return rows, batch

    def _run(self, batch: list[MicroBatch], objective: PolicyObjective, forward_only: bool):
        """Every micro-batch forward (and backward) through the model or the pipeline."""
        in_precision = self._autocast
        if self.pipeline is not None:
            self.pipeline.run(batch, objective, 1.0, in_precision, forward_only=forward_only)
            return
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        for micro in batch:
            with grad, in_precision():
                losses = objective(self.model, micro)
            if not forward_only:
                losses.total.backward()

    def _autocast(self):
        return autocast(self.cfg, self.ps.device)
