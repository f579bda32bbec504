"""`megatronish bench`: times training steps and checks the bytes each rank sends per step
against the analytic count.

The run is the config's training run with evaluation and checkpointing switched off: W warm-up
steps, then N timed steps, each inside a ``comm.CommCounter``. Rank 0 prints a short summary and,
as its last line, one JSON object. Run as a plain process with a config whose world size
(tp * cp * dp * pp) is above 1, the command re-launches itself under torchrun with one process
per rank.

Communication formula (bytes one rank sends per optimizer step, ring algorithm, as
``comm.CommCounter`` counts them): see ``megatronish.accounting.collectives``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatronish.accounting.collectives import formula_bytes_per_step, formula_payload_by_kind
from megatronish.config import Config, Derived, load_config, world_size_of
from megatronish.distributed import comm
from megatronish.errors import UserError
from megatronish.observe.phases import FIELDS, current_rss, peak_memory
from megatronish.training.metrics import mfu_text


@dataclass
class BenchResult:
    """What `time_steps` measured on this rank. The byte and call counts are per step (the
    mean over the timed steps; every step issues the same collectives)."""

    step_times: list[float]
    bytes_sent_per_step: float
    payload_per_step: dict[str, float]
    calls_per_step: float
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float
    peak_source: str
    world_size: int
    losses: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    """This rank's mean phase times and waits per timed step (megatronish.observe.phases)."""

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        return self.flops_per_step / self.step_time_s / (self.peak_flops * self.world_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(trainer, steps: int, warmup: int) -> BenchResult:
    """Runs `warmup` untimed and then `steps` timed optimizer steps of a ``Trainer``, counting
    each timed step's collectives. Every rank calls it; the ranks line up at a barrier first."""
    device = trainer.ps.device
    for _ in range(warmup):
        trainer.train_step()
    _sync(device)
    if dist.is_initialized():
        dist.barrier()
    trainer.timer.take()  # the timed steps' phases only
    times, losses = [], []
    with comm.CommCounter() as counter:
        for _ in range(steps):
            start = time.perf_counter()
            loss = trainer.train_step().loss
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(loss)
    return BenchResult(
        step_times=times,
        bytes_sent_per_step=counter.total_sent / steps,
        payload_per_step={k: v / steps for k, v in counter.payload_bytes.items()},
        calls_per_step=sum(counter.calls.values()) / steps,
        tokens_per_step=trainer.setup.derived.tokens_per_step,
        flops_per_step=trainer.flops_per_step,
        peak_flops=trainer.peak,
        peak_source=trainer.peak_source,
        world_size=trainer.ps.world_size,
        losses=losses,
        phases=dict(zip(FIELDS, trainer.timer.take() or [])),
    )


def bench_overrides(steps: int, warmup: int) -> list[str]:
    """`--set` overrides that turn a training config into a benchmark run: exactly
    warmup + steps steps, no evaluation, no checkpoints written or resumed."""
    from megatronish.config import CheckpointConfig

    sets = [f"train.steps={warmup + steps}", "train.eval_every=0"]
    fields = CheckpointConfig.__dataclass_fields__
    if "save" in fields:
        sets.append("checkpoint.save=false")
    if "resume" in fields:
        sets.append("checkpoint.resume=never")
    return sets


def _format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(cfg: Config, derived: Derived, result: BenchResult, steps: int, warmup: int) -> dict:
    """The JSON record of a benchmark (the last line the command prints)."""
    formula = formula_bytes_per_step(cfg, derived)
    ring_formula = formula_payload_by_kind(cfg, derived).get("cp_ring", 0)
    return {
        "tokens_per_s": result.tokens_per_s,
        "step_time_s": result.step_time_s,
        "mfu": result.mfu,
        "tp": derived.tp,
        "dp": derived.dp,
        "pp": derived.pp,
        "cp": derived.cp,
        "world_size": derived.world_size,
        "bytes_sent_per_step": result.bytes_sent_per_step,
        "bytes_sent_per_step_formula": formula,
        "cp_ring_bytes_per_step": result.payload_per_step.get("cp_ring", 0.0),
        "cp_ring_bytes_per_step_formula": ring_formula,
        "exposed_dp_wait_s": result.phases.get("wait_dp", 0.0),
        "exposed_tp_wait_s": result.phases.get("wait_tp", 0.0),
        "tp_comm_overlap": cfg.parallel.tp_comm_overlap and derived.tp > 1,
        "tp_ring_bytes_per_step": result.payload_per_step.get("tp_ring", 0.0),
        "grad_sync_s": result.phases.get("grad_sync", 0.0),
        "overlap_grad_reduce": cfg.optim.overlap_grad_reduce,
        "comm_calls_per_step": result.calls_per_step,
        "steps": steps,
        "warmup": warmup,
        "step_time_min_s": min(result.step_times),
        "step_time_max_s": max(result.step_times),
        "tokens_per_step": derived.tokens_per_step,
        "arch": cfg.model.arch,
        "precision": cfg.train.precision,
        "peak_source": result.peak_source,
    }


def summary_lines(cfg: Config, derived: Derived, record: dict) -> list[str]:
    """The human-readable lines printed before the JSON record."""
    model, train = cfg.model, cfg.train
    sent, formula = record["bytes_sent_per_step"], record["bytes_sent_per_step_formula"]
    calls = f" in {record['comm_calls_per_step']:.0f} collectives"
    overlap = "on" if record["overlap_grad_reduce"] else "off"
    lines = [_sent_line("sent per step by rank 0", sent, formula, calls)]
    if derived.cp > 1:
        lines.append(
            _sent_line(
                "of which ring attention (k, v and their gradients)",
                record["cp_ring_bytes_per_step"],
                record["cp_ring_bytes_per_step_formula"],
            )
        )
    if derived.tp > 1:
        under = "on" if record["tp_comm_overlap"] else "off"
        lines.append(
            f"rank 0 waits {record['exposed_tp_wait_s'] * 1e3:.2f} ms a step in tensor-parallel "
            f"communication (under the GEMMs {under}; ring hops "
            f"{_format_bytes(record['tp_ring_bytes_per_step'])})"
        )
    return [
        f"bench: {model.arch} {model.n_layer} layers, d_model {model.d_model}, {train.precision}; "
        f"tp {derived.tp} x cp {derived.cp} x dp {derived.dp} x pp {derived.pp} "
        f"(world {derived.world_size}); "
        f"micro-batch {train.micro_batch_size} x seq {train.seq_len}, {derived.grad_accum_steps} "
        "accumulation steps",
        f"step time {record['step_time_s']:.4f} s (median of {record['steps']} after "
        f"{record['warmup']} warm-up; min {record['step_time_min_s']:.4f}, max "
        f"{record['step_time_max_s']:.4f}); {record['tokens_per_s']:.0f} tokens/s; "
        f"MFU {mfu_text(record['mfu'], record['peak_source'], digits=2)}",
        *lines,
        f"rank 0 waits {record['exposed_dp_wait_s'] * 1e3:.2f} ms a step in data-parallel "
        f"communication (gradient reduction overlap {overlap}); gradient sync phase "
        f"{record['grad_sync_s'] * 1e3:.2f} ms",
    ]


def memory_line(record: dict) -> str:
    """Measured peak memory next to plan's estimate."""
    above = record["peak_memory_above_start_gb"]
    return (
        f"peak memory per rank (max over ranks): {record['peak_memory_gb'] * 1024:.1f} MiB, "
        f"{above * 1024:.1f} MiB above the process before the model was built; plan's "
        f"estimate {record['plan_memory_gb'] * 1024:.1f} MiB "
        f"(measured above start / plan = {above / record['plan_memory_gb']:.2f})"
    )


def _sent_line(what: str, sent: float, formula: float, calls: str = "") -> str:
    verdict = "matches" if abs(sent - formula) <= 1e-9 * max(1.0, formula) else "DIFFERS"
    return (
        f"{what}: {_format_bytes(sent)}{calls}; analytic count {_format_bytes(formula)} ({verdict})"
    )


def memory_record(cfg: Config, derived: Derived, ps, rss_before: float) -> dict:
    """Peak memory per rank, the max over the ranks (every rank calls this), next to plan's
    estimate for the same layout. On CPU the peak is the resident set size, which also holds
    the interpreter and torch's libraries: `peak_memory_above_start_gb` leaves out what the
    process held before it built the model."""
    import dataclasses

    from megatronish.accounting.memory import estimate

    peak, reserved = peak_memory(ps.device)
    above = peak - rss_before if ps.device.type == "cpu" else peak
    mine = torch.tensor([peak, reserved, above], dtype=torch.float64, device=ps.device)
    if ps.world_size > 1:
        comm.all_reduce(mine, None, op=dist.ReduceOp.MAX)
    sized = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=derived.vocab_size)
    )
    plan = estimate(
        sized,
        derived.world_size,
        derived.tp,
        derived.pp,
        derived.cp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        zero=cfg.optim.zero,
        activation_checkpointing=cfg.train.activation_checkpointing,
    )
    return {
        "peak_memory_gb": float(mine[0]) / 2**30,
        "peak_reserved_gb": float(mine[1]) / 2**30,
        "peak_memory_above_start_gb": float(mine[2]) / 2**30,
        "plan_memory_gb": plan.total_gb,
    }


def run_bench(cfg: Config, steps: int, warmup: int) -> dict:
    """Benchmarks this process's rank of `cfg` (already carrying ``bench_overrides``); rank 0
    prints the summary and the JSON line. Returns the JSON record."""
    from megatronish.training.setup import setup
    from megatronish.training.trainer import Trainer

    built = setup(cfg)
    trainer = None
    try:
        before = current_rss()
        trainer = Trainer(built)
        result = time_steps(trainer, steps, warmup)
        record = report(cfg, built.derived, result, steps, warmup)
        record.update(memory_record(cfg, built.derived, built.ps, before))
        if built.ps.is_main:
            for line in [*summary_lines(cfg, built.derived, record), memory_line(record)]:
                print(line)
            print(json.dumps(record), flush=True)
        return record
    finally:
        if trainer is not None:
            trainer.profiler.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def bench_in_subprocess(
    config: str, steps: int, sets: list[str], env: dict[str, str] | None = None
) -> dict:
    """The JSON record of `megatronish bench --config config --steps steps --set ...` run in a
    fresh process (for scripts that compare variants side by side)."""
    import subprocess

    args = [sys.executable, "-m", "megatronish", "bench", "--config", config, "--steps", str(steps)]
    for item in sets:
        args += ["--set", item]
    environ = None if env is None else {**os.environ, **env}
    result = subprocess.run(args, capture_output=True, text=True, check=True, env=environ)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _torchrun(args: list[str]) -> int:
    """torch.distributed.run's main with args; its exit status (2 when every rank failed with a
    user error, 1 for any other failure)."""
    from torch.distributed import run as torchrun

    try:
        torchrun.main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: the ranks printed their own errors
        failures = getattr(exc, "failures", {})
        codes = [f.exitcode for f in failures.values()] if failures else [1]
        return 2 if all(code == 2 for code in codes) else 1
    return 0


def bench(config_path: str, overrides: tuple[str, ...], steps: int, warmup: int) -> int:
    """`megatronish bench`: benchmarks in this process under torchrun or when the world is 1;
    otherwise starts tp * cp * dp * pp processes through torchrun with the same arguments
    (sharing this machine's cores between them unless OMP_NUM_THREADS is set). Returns the
    exit status."""
    if steps < 1:
        raise UserError(f"--steps {steps}: must be at least 1")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: must be at least 0")
    cfg = load_config(config_path, list(overrides) + bench_overrides(steps, warmup))
    world = world_size_of(cfg)
    if "WORLD_SIZE" in os.environ or world == 1:
        run_bench(cfg, steps, warmup)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    args = ["--standalone", f"--nproc-per-node={world}", "-m", "megatronish", "bench"]
    args += ["--config", config_path, "--steps", str(steps), "--warmup", str(warmup)]
    for override in overrides:
        args += ["--set", override]
    sys.stdout.flush()
    return _torchrun(args)
