"""Per-rank phase times of a training step, gathered over the ranks, and the straggler.

A step is data (the loader), forward, backward, bubble (the pipeline's waits for its neighbour
stages), grad_sync (gradient reduction, clipping, the step agreement) and optimizer (the update);
these add up to the step. Inside them, the time this rank was blocked in communication is
counted per group kind by megatronish.observe.record (wait_tp, wait_cp, wait_ep, wait_dp,
wait_pp, wait_world; the exposed wait, not the collectives' whole span). compute = step - all
waits: a rank that computes slowly makes the others wait for it, so its own waits are short and
its compute long, while synchronizing collectives make every rank's step time the same.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time

import torch

from megatronish.observe.record import KINDS, RECORDER

PHASES = ("data", "forward", "backward", "bubble", "grad_sync", "optimizer")
WAITS = tuple(f"wait_{kind}" for kind in KINDS)
# What each rank reports per logged step (means over the steps since the last log), in order.
FIELDS = ("step", *PHASES, *WAITS, "compute", "peak_memory", "peak_reserved")


def current_rss() -> float:
    """This process's resident set size now, in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return float(int(statm.read().split()[1]) * resource.getpagesize())
    except OSError:
        return 0.0


def peak_memory(device: torch.device) -> tuple[float, float]:
    """(peak bytes, peak reserved bytes) of this process: CUDA's peak allocated and reserved
    memory, or on CPU the peak resident set size (both values)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), float(
            torch.cuda.max_memory_reserved(device)
        )
    rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
    return rss, rss


class PhaseTimer:
    """Seconds per phase, and waits per group kind, of this rank's steps since the last take().
    Phases count only inside step() (not evaluation or checkpoints between steps). Disabled,
    step() and phase() are no-op contexts and take() returns None."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self._null = contextlib.nullcontext()
        self._in_step = False
        self._clear()

    def _clear(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.waits = dict.fromkeys(KINDS, 0.0)
        self.step_s, self.steps = 0.0, 0

    @contextlib.contextmanager
    def step(self):
        """The body is one training step."""
        if not self.enabled:
            yield
            return
        waits, start = dict(RECORDER.waits), time.perf_counter()
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        self.step_s += time.perf_counter() - start
        self.steps += 1
        for kind in KINDS:
            self.waits[kind] += RECORDER.waits[kind] - waits[kind]

    def phase(self, name: str):
        """A context that adds its duration to phase `name` (inside a step)."""
        return _Phase(self.totals, name) if self._in_step else self._null

    def take(self) -> list[float] | None:
        """This rank's FIELDS (means per step since the last take) and a fresh start."""
        if not self.enabled or self.steps == 0:
            return None
        n = self.steps
        waits = [self.waits[kind] / n for kind in KINDS]
        step = self.step_s / n
        row = [step, *(self.totals[p] / n for p in PHASES), *waits, step - sum(waits)]
        row += list(peak_memory(self.device))
        self._clear()
        return row


class _Phase:
    __slots__ = ("totals", "name", "start")

    def __init__(self, totals: dict, name: str):
        self.totals, self.name = totals, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.totals[self.name] += time.perf_counter() - self.start


def gather_rows(row: list[float] | None, world_size: int, device) -> list[list[float]] | None:
    """Every rank's FIELDS row, in rank order (one all-gather over the world; every rank calls
    it on the same steps). None when phase times are off."""
    from megatronish.distributed import comm

    if row is None:
        return None
    if world_size == 1:
        return [row]
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    rows = torch.empty(world_size * len(row), dtype=torch.float64, device=device)
    comm.all_gather_into(rows, mine, None)
    return rows.view(world_size, len(row)).tolist()


def summarize(rows: list[list[float]], straggler_ratio: float) -> dict:
    """metrics.jsonl fields from every rank's FIELDS row (in rank order): "phases" with each
    field's min / median / max over the ranks and the rank of the max (seconds, memory in
    bytes), "peak_memory_gb" and its rank, and "straggler": the rank whose compute is more than
    straggler_ratio times the median (the slowest such), or None."""
    phases = {}
    for index, name in enumerate(FIELDS):
        values = [row[index] for row in rows]
        top = max(range(len(values)), key=values.__getitem__)
        key = name if name.startswith("peak") else f"{name}_s"
        phases[key] = {
            "min": min(values),
            "median": statistics.median(values),
            "max": values[top],
            "max_rank": top,
        }
    compute = phases["compute_s"]
    straggler = None
    if compute["median"] > 0 and compute["max"] > straggler_ratio * compute["median"]:
        straggler = compute["max_rank"]
    memory = phases["peak_memory"]
    return {
        "phases": phases,
        "peak_memory_gb": memory["max"] / 2**30,
        "peak_memory_rank": memory["max_rank"],
        "straggler": straggler,
    }


def straggler_line(step: int, summary: dict, ratio: float) -> str:
    """The line rank 0 prints when summary names a straggler."""
    compute = summary["phases"]["compute_s"]
    rank = summary["straggler"]
    return (
        f"step {step}: rank {rank} is a straggler: it computes {compute['max']:.4f} s a step, "
        f"{compute['max'] / compute['median']:.2f}x the median {compute['median']:.4f} s "
        f"(observe.straggler_ratio={ratio}); the other ranks wait for it"
    )
