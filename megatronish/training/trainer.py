"""The training loop: micro-batches -> backward -> gradient reduction -> clip -> AdamW.

Rank 0 shows a progress bar and writes metrics.jsonl; the other ranks print nothing but errors.
After the gradients of a step, the ranks agree (megatronish.training.faults) whether to apply
the update (not when the loss or gradient norm is non-finite on any rank) and whether to stop
after it (a rank got SIGTERM, SIGUSR1 or a first Ctrl-C): then it saves a checkpoint, exits 0.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from megatronish import fp8
from megatronish.accounting.flops import model_flops_per_step
from megatronish.checkpoint.lock import run_lock
from megatronish.config import Config
from megatronish.data_parallel import data_parallel_for
from megatronish.errors import RunFailure
from megatronish.model import GPT
from megatronish.model.precision import autocast
from megatronish.moe import Balancer, step_metrics
from megatronish.objectives.batch import micro_batches
from megatronish.objectives.registry import train_objective
from megatronish.observe import flight
from megatronish.observe.phases import PhaseTimer, gather_rows, straggler_line, summarize
from megatronish.observe.profile import StepProfiler
from megatronish.optim.optimizer import lr_at
from megatronish.optim.qk_clip import QKClip
from megatronish.pipeline.runner import Pipeline
from megatronish.training import checkpoints, faults, preference
from megatronish.training.batches import next_batch
from megatronish.training.loss import loss_divisor, mean_losses
from megatronish.training.metrics import (
    MetricsWriter,
    peak_flops,
    progress_postfix,
    summary_line,
)
from megatronish.training.resume import checkpoint_dir
from megatronish.training.setup import Setup, make_loader, setup, write_data_report
from megatronish.training.window import StepWindow


@dataclass(frozen=True)
class StepResult:
    """One optimizer step attempt: the loss (mean over the global batch), the gradient norm
    before clipping, and what the ranks agreed to do with it."""

    loss: float
    grad_norm: float
    verdict: faults.StepVerdict
    mtp_loss: float | None = None
    """The multi-token prediction loss (mean over the depths and the global batch), or None
    without model.mtp_depth."""


class Trainer:
    def __init__(self, setup: Setup, stop_signals: faults.StopSignals | None = None):
        self.setup, self.cfg, self.ps = setup, setup.cfg, setup.ps
        self.saver = checkpoints.Saver(setup)  # checkpoint.async: starts the writer thread first
        # The default stream (dropout on replicated activations) is the same on every rank.
        torch.manual_seed(setup.cfg.train.seed)
        self.model = GPT(setup.cfg, setup.derived, setup.ps)
        self.objective = train_objective(setup.cfg, setup.ps)  # what the steps minimize
        # The sigmoid router's routing biases and load spread (moe.balance).
        self.balancer = Balancer(self.model.moe_layers(), setup.cfg, setup.derived, setup.ps)
        self.qk_clip = QKClip(self.model, setup.cfg, setup.ps)  # optim.muon.qk_clip_tau
        # Phase times of every step on this rank (observe.phase_times).
        self.timer = PhaseTimer(setup.cfg.observe.phase_times, setup.ps.device)
        self.observed = False  # whether a logged window has been observed yet
        self.profiler = StepProfiler(setup.cfg, setup.ps.rank, setup.ps.device)
        self.pipeline = (
            Pipeline(self.model, setup.ps, setup.cfg.parallel.pp_schedule, timer=self.timer)
            if setup.derived.pp > 1
            else None
        )
        # The gradients' reduction, clipping, AdamW and ZeRO (optim.zero): data_parallel.
        self.data_parallel = data_parallel_for(self.model, setup.cfg, setup.ps)
        self.loader = make_loader(setup, "train")
        self.val_loader = make_loader(setup, "val") if setup.cfg.train.eval_every > 0 else None
        self.out_dir = Path(setup.cfg.run.out_dir)
        self.flops_per_step = model_flops_per_step(setup.cfg, setup.derived)
        self.peak, self.peak_source = peak_flops(setup.ps.device)
        # The step resumed from (checkpoint.resume), or None for a fresh start.
        self.resumed_from = checkpoints.start(setup, self.model, self.data_parallel, self.loader)
        self.step = self.resumed_from or 0
        self.reference = None  # DPO: each pair's reference log-probabilities (preference.py)
        if setup.cfg.train.objective == "dpo":
            args = (self.loader, self.objective, self.pipeline, self.data_parallel)
            resumed = self.resumed_from is not None
            self.reference = preference.reference_for(
                setup.cfg, setup.ps, self.model, *args, resumed
            )
        self.mtp_loss: float | None = None  # of the last compute_gradients (model.mtp_depth)
        self.saved_step = self.resumed_from
        # Asks to stop at a step boundary once installed (train() installs it).
        self.stop_signals = stop_signals or faults.StopSignals()
        self.stop_signals.settled = self.step

    def train_step(self) -> StepResult:
        """One optimizer step attempt over the next global batch. Its update is skipped on every
        rank when the loss or gradient norm is not finite on any; the step counts either way."""
        self.profiler.begin_step(self.step + 1)
        with self.timer.step(), fp8.weights_fixed():  # fp8 weight casts kept for the step
            loss, grad_norm = self.compute_gradients()
            asked = self.stop_signals.asked()
            with self.timer.phase("grad_sync"):
                writing = self.saver.writing
                verdict = faults.agree_on_step(loss, grad_norm, asked, self.ps, writing)
            self.stop_signals.agreed(self.step + 1, verdict.stop)
            with self.timer.phase("optimizer"):
                if not verdict.skip:
                    self.data_parallel.step(lr_at(self.step + 1, self.cfg))
                self.data_parallel.after_step()
                self.balancer.after_step(applied=not verdict.skip)
                self.qk_clip.after_step(applied=not verdict.skip)
        self.step += 1
        self.profiler.end_step(self.step)
        return StepResult(loss, grad_norm, verdict, self.mtp_loss)

    def compute_gradients(self) -> tuple[float, float]:
        """Forward and backward over the next global batch, gradients reduced and clipped:
        (loss mean over the global batch, global gradient norm before clipping); the
        multi-token prediction loss's mean goes to self.mtp_loss (None without it)."""
        timer, depth = self.timer, self.cfg.model.mtp_depth
        with timer.phase("data"):
            # [accum, micro, seq / cp] each; documents None unless data.document_mask, the
            # tokens and targets ahead ([accum, micro, 2, D, seq / cp]) None unless mtp_depth 0
            inputs, targets, documents, future_tokens = next_batch(
                self.loader, self.ps, self.cfg.data.document_mask, depth
            )
            accum = inputs.shape[0]
            divisor = None  # with a loss mask, from the global batch's counted tokens (loss.py)
            if self.loader.masks_loss and self.ps.is_last_stage and self.reference is None:
                divisor = loss_divisor(targets, future_tokens, self.ps) / accum
            batch = micro_batches(inputs, targets, divisor, documents, future_tokens)
            if self.reference is not None:
                batch = preference.with_reference(batch, self.reference, self.loader.last_pairs)
        self.data_parallel.start_of_step(accum)
        self.model.set_moe_loss_scale(1.0 / accum)
        if self.pipeline is not None:
            loss_sum = self.pipeline.run(batch, self.objective, 1.0 / accum, self.autocast)
            mtp_sum = self.pipeline.mtp_sum
        else:
            loss_sum = torch.zeros((), device=self.ps.device)
            mtp_sum = torch.zeros((), device=self.ps.device)
            for micro in batch:
                with timer.phase("forward"), self.autocast():
                    losses = self.objective(self.model, micro)
                with timer.phase("backward"):
                    (losses.total / accum).backward()
                loss_sum += losses.main.detach()
                if losses.mtp is not None:
                    mtp_sum += losses.mtp.detach()
        with timer.phase("grad_sync"):
            self.data_parallel.after_backward()
            grad_norm = self.data_parallel.clip_grads(self.cfg.train.grad_clip)
            mtp_sum = mtp_sum / accum if depth > 0 else None
            loss, self.mtp_loss = mean_losses(loss_sum / accum, mtp_sum, self.ps)
        return loss, grad_norm

    def autocast(self):
        return autocast(self.cfg, self.ps.device)

    def evaluate(self) -> float:
        return self.validation()["val_loss"]

    @torch.no_grad()
    def validation(self) -> dict[str, float]:
        """The validation metrics of the model now, from the start of the validation split
        (preference.validation)."""
        assert self.val_loader is not None
        self.model.eval()
        self.val_loader.reset()
        args = (self.objective, self.reference, self.cfg, self.ps, self.pipeline)
        evaluated = preference.validation(self.model, self.val_loader, *args)
        self.data_parallel.after_eval()
        self.model.train()
        return evaluated

    def write_run_files(self) -> None:
        if not self.ps.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.yaml").write_text(
            yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
        )
        derived = dict(vars(self.setup.derived), dataset=str(self.setup.dataset_dir))
        (self.out_dir / "derived.json").write_text(json.dumps(derived, indent=2) + "\n")
        total = self.cfg.train.steps * self.cfg.train.global_batch_size
        write_data_report(self.out_dir, self.loader, self.setup.data, total)

    def run(self) -> dict:
        """Trains to train.steps, or until a rank is asked to stop (SIGTERM, SIGUSR1, Ctrl-C, once
        stop_signals are installed; it saves first); returns the last metrics line (and
        val_loss if computed)."""
        cfg, ps = self.cfg, self.ps
        metrics, bar = self.open_outputs()
        last: dict = {}
        window = StepWindow()
        skipped_in_a_row, stopped, interrupted = 0, False, False
        try:
            while self.step < cfg.train.steps and not stopped:
                result = self.train_step()
                self.saver.poll(result.verdict)  # completes a background save once written
                window.step_done()
                skipped_in_a_row = skipped_in_a_row + 1 if result.verdict.skip else 0
                if result.verdict.skip:
                    self.record_skip(metrics, result.verdict, skipped_in_a_row)
                elif self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps:
                    last = self.log_step(metrics, bar, result, window.mean_step_s())
                    window.restart()
                bar.update(1)
                every = cfg.train.eval_every
                if self.val_loader is not None and (
                    self.step % every == 0 or self.step == cfg.train.steps
                ):
                    with window.paused():
                        evaluated = self.validation()
                    metrics.write({"step": self.step, **evaluated})
                    last = dict(last, **evaluated)
                if checkpoints.due(self.step, cfg):
                    with window.paused():
                        self.save_checkpoint()
                stopped = result.verdict.stop
            if cfg.checkpoint.save and self.saved_step != self.step:
                self.save_checkpoint()
            self.saver.finish()  # checkpoint.async: the last save on disk before the run ends
            self.stop_signals.done()  # a Ctrl-C from here on no longer aborts
            self.data_parallel.make_whole()  # the model is whole when the run returns
        except KeyboardInterrupt:  # a second Ctrl-C stops the run at once
            interrupted = True
            raise
        finally:
            self.saver.close(wait=not interrupted)
            bar.close()
            metrics.close()
            self.profiler.close()
        if stopped and ps.is_main and self.step < cfg.train.steps:  # else: it simply finished
            why = self.stop_signals.requested
            line = faults.stop_report(self.step, cfg.train.steps, why, cfg.checkpoint.save)
            print(line, flush=True)
        return last

    def open_outputs(self) -> tuple[MetricsWriter, tqdm]:
        """The run files written; metrics.jsonl opened (on a resume: appended to, its lines
        after the resumed step dropped first) and the progress bar (rank 0's)."""
        cfg, ps = self.cfg, self.ps
        self.write_run_files()
        resumed = self.resumed_from is not None
        if resumed and ps.is_main:
            checkpoints.trim_metrics(self.out_dir, self.step)
        metrics = MetricsWriter(
            self.out_dir, enabled=ps.is_main, append=resumed, tensorboard=cfg.observe.tensorboard
        )
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.step,
            disable=not ps.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        return metrics, bar

    def log_step(
        self, metrics: MetricsWriter, bar: tqdm, result: StepResult, step_time: float
    ) -> dict:
        """The metrics line of a logged step (`step_time`: the mean seconds a step since the
        last one), written and shown on the progress bar; every rank calls it (the MoE and
        phase metrics are gathered)."""
        last = {
            "step": self.step,
            "loss": result.loss,
            "lr": lr_at(self.step, self.cfg),
            "grad_norm": result.grad_norm,
            "tokens_per_s": self.setup.derived.tokens_per_step / step_time,
            "mfu": self.flops_per_step / step_time / (self.peak * self.ps.world_size),
            "step_time_s": step_time,
        }
        if result.mtp_loss is not None:
            last["mtp_loss"] = result.mtp_loss
        last.update(preference.step_metrics(self.objective, self.ps))
        last.update(self.moe_metrics() | self.qk_clip.metrics())
        last.update(self.observe_step())
        metrics.write(last)
        bar.set_postfix(**progress_postfix(last, self.peak_source, self.cfg))
        return last

    def moe_metrics(self) -> dict:
        """The MoE layers' router metrics since the last logged step (every rank calls this;
        none without experts)."""
        stats = {index: layer.stats for index, layer in self.model.moe_layers().items()}
        moe = self.cfg.model.moe
        biased = moe.router == "sigmoid"
        layers = self.setup.derived.moe_layers
        metrics = step_metrics(stats, layers, moe.num_experts, self.ps, biased)
        return metrics | self.balancer.metrics()

    def observe_step(self) -> dict:
        """On a logged step: the phase times and peak memory of every rank since the last one,
        gathered (every rank calls this), as metrics fields; rank 0 names a straggler. The
        first logged window of a process, which pays one-time start-up costs (first kernels,
        first connections) unevenly, names none."""
        rows = gather_rows(self.timer.take(), self.ps.world_size, self.ps.device)
        if rows is None:
            return {}
        ratio = self.cfg.observe.straggler_ratio
        summary = summarize(rows, ratio)
        if not self.observed:
            summary["straggler"], self.observed = None, True
        if summary["straggler"] is not None and self.ps.is_main:
            tqdm.write(straggler_line(self.step, summary, ratio))
        return summary

    def record_skip(self, metrics: MetricsWriter, verdict: faults.StepVerdict, in_a_row: int):
        """Writes the metrics line of a skipped step; after train.max_skipped_steps in a row,
        stops the run: a RunFailure on every rank, before this step is saved."""
        names = " and ".join(verdict.nonfinite)
        metrics.write(
            {"step": self.step, "skipped": f"non-finite {names}", "skipped_in_a_row": in_a_row}
        )
        limit = self.cfg.train.max_skipped_steps
        if in_a_row >= limit:
            raise RunFailure(
                f"steps {self.step - in_a_row + 1} to {self.step}: {in_a_row} in a row had a "
                f"non-finite loss or gradient norm (train.max_skipped_steps={limit}); the run "
                "stops here: lower train.lr, or check the data of these steps",
                rank0_prints=True,
            )

    def save_checkpoint(self) -> None:
        """Saves a checkpoint of this step, or starts saving it (checkpoint.async); every rank
        calls it."""
        self.saver.save(self.step, self.model, self.data_parallel, self.loader)
        self.saved_step = self.step


def train(cfg: Config) -> dict:
    """Runs `megatronish train` for this process (one rank); returns the last metrics. Rank 0
    holds the lock of checkpoint.dir while the run may read or write there. Nothing is written
    until the run is built and restored (a config error found on the way creates nothing). A
    rank that fails because another rank went away raises a one-line RunFailure (only rank 0
    prints it): the rank that failed first has printed the error."""
    built = setup(cfg)
    # The flight recorder's watchdog: a hang report in <run.out_dir>/debug on a collective that
    # does not finish, on SIGUSR2, or when another rank asks (see megatronish diagnose).
    watchdog = flight.watchdog_for(cfg, built.ps)
    # From here to the end SIGTERM, SIGUSR1 and a first Ctrl-C only ask to stop, so a rank that
    # torchrun terminates because another rank failed still gets to say so in one line.
    notice = faults.interrupt_notice(cfg.checkpoint.save, cfg.train.steps)
    stop_signals = faults.StopSignals(notice if built.ps.is_main else None)
    directory = checkpoint_dir(cfg)
    try:
        stop_signals.install()
        with contextlib.ExitStack() as held:
            lock_first = checkpoints.lock_before_building(built)
            if lock_first:
                held.enter_context(run_lock(directory, built.ps))
            trainer = Trainer(built, stop_signals)
            if cfg.checkpoint.save and not lock_first:
                held.enter_context(run_lock(directory, built.ps))
            summary = trainer.run()
        if built.ps.is_main and summary:
            print(summary_line(summary, trainer.peak_source), flush=True)
        return summary
    except KeyboardInterrupt:  # a second Ctrl-C
        raise checkpoints.aborted(cfg, built.ps.is_main) from None
    except Exception as exc:
        reason = faults.lost_peer(exc)
        if reason is None:
            raise
        raise RunFailure(
            f"rank {built.ps.rank}: stopped because another rank failed ({reason})",
            rank0_prints=True,
        ) from exc
    finally:
        try:
            if watchdog is not None:
                watchdog.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            stop_signals.restore()  # last: a run done ignores Ctrl-C while it tears down
