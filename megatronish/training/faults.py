"""What a run does when something goes wrong around it or inside it.

- Its launcher dies (kill -9 of torchrun or `megatronish launch`): every rank asked the kernel
  for SIGKILL when its parent dies (megatronish.distributed.processes), so no rank trains on
  as an orphan. SIGKILL leaves nothing half-done: a checkpoint is written under a temporary
  name and renamed, `latest` is replaced last, and a resumed run drops a partial metrics line.
- A second run starts on the same checkpoint.dir: see megatronish.checkpoint.lock.
- The run is asked to stop (SIGTERM, or SIGUSR1 as Slurm sends before a time limit) on any rank
  or on its launcher: `StopSignals` turns the signal into a request, and the ranks agree on it
  at the end of the step (`agree_on_step`), save a checkpoint and exit with status 0.
- Ctrl-C (SIGINT): the first asks the same and says so in one line; a second aborts at once
  (KeyboardInterrupt; the run exits 130, leaving no unfinished save). Once the run's last save
  is on disk, Ctrl-C is ignored: the process finishes its exit with its status (0), with no
  traceback. A launcher passes SIGINT on to its ranks as it does SIGTERM, and leaves torchrun
  after a second.
- A step's loss or gradient norm is not finite on some rank: `agree_on_step` makes every rank
  skip that optimizer update alike.
- Another rank fails: the collective this rank waits in fails (gloo sees the connection close,
  the shared-memory path sees the process gone, or parallel.timeout_s passes); `lost_peer`
  recognises that, and the rank exits with status 1 and no traceback of its own (rank 0 says
  in one line that another rank failed; the rank that failed has printed why).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatronish.distributed import comm
from megatronish.distributed.processes import child_pids
from megatronish.errors import PeerLost

if TYPE_CHECKING:
    from megatronish.distributed.layout import ParallelState

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def handled() -> tuple[signal.Signals, ...]:
    """The signals a run turns into a stop request: STOP_SIGNALS, and SIGINT (whose second one
    aborts) unless this process ignores it, as a shell's background job does."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    return STOP_SIGNALS if ignored else (*STOP_SIGNALS, signal.SIGINT)


# What gloo says when the other end of a collective has gone away or stopped answering.
GLOO_PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
)


# --------------------------------------------------------------------------------------------
# Stop requests and the agreement at the end of each step


class StopSignals:
    """Between install() and restore(), SIGTERM and SIGUSR1 no longer end the process: they ask
    the run to stop at the end of the current step (`requested` names the first signal; None:
    not asked). So does a first SIGINT (Ctrl-C), which also writes notice(the step the run
    stops after; None before the run has one) to stderr when notice is given: at once, or, when
    it comes while the step in progress is being decided on (between asked() and agreed(), so
    the ranks may see it at that step or the next), once every rank has agreed. A second SIGINT
    raises KeyboardInterrupt at once; later ones are ignored while the run unwinds, and so is
    any after done(). restore() puts the previous handlers back."""

    def __init__(self, notice: Callable[[int | None], str] | None = None) -> None:
        self.requested: str | None = None
        self.notice = notice
        self.settled: int | None = None  # the last step every rank agreed on (agreed)
        self.interrupts = 0
        self._done = False  # done(): the run trained and saved what it saves
        self._deciding = False
        self._notice_due = False
        self._previous: dict[int, object] = {}

    def asked(self) -> bool:
        """Whether this rank was asked to stop, as the step in progress decides (its stop flag
        for agree_on_step)."""
        self._deciding = True
        return self.requested is not None

    def agreed(self, step: int, stop: bool) -> None:
        """Every rank agreed on step `step`'s verdict (stop: the run stops after it)."""
        self._deciding, self.settled = False, step
        if self._notice_due:
            self._notice_due = False
            self._say(step if stop else step + 1)

    def done(self) -> None:
        """The run's last save is on disk (or it saves nothing): nothing is left for a Ctrl-C to
        stop or abort, so SIGINT is ignored from here on."""
        self._done = True

    def _say(self, step: int | None) -> None:
        # os.write: the main thread may be inside a print to stderr. On a line of its own, below
        # the progress bar, which tqdm then draws again on the next line.
        if self.notice is not None:
            os.write(2, ("\n" + self.notice(step) + "\n").encode())

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            if self._done:
                return
            self.interrupts += 1
            if self.interrupts > 1:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                raise KeyboardInterrupt
            if self._deciding:
                self._notice_due = True
            else:
                self._say(None if self.settled is None else self.settled + 1)
        if self.requested is None:
            self.requested = signal.Signals(signum).name

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in handled()}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def interrupt_notice(saves: bool, steps: int) -> Callable[[int | None], str]:
    """The notice of a run's first Ctrl-C (StopSignals), for a run that saves or not and ends
    at step `steps` anyway."""

    def notice(step: int | None) -> str:
        when = "its first step" if step is None else f"step {min(step, steps)}"
        saving = "and saving" if saves else "(checkpoint.save is false: nothing is saved)"
        return (
            f"interrupted: stopping at the end of {when} {saving}; press Ctrl-C again to abort now"
        )

    return notice


def stop_report(step: int, steps: int, requested: str | None, saves: bool) -> str:
    """The line rank 0 prints when the run stopped early because a rank was asked to."""
    why = requested or "asked on another rank"
    saved = (
        f"saved step {step}; run the same command again to continue"
        if saves
        else "nothing saved (checkpoint.save is false)"
    )
    return f"stopped at step {step} of {steps} ({why}): {saved}"


@contextlib.contextmanager
def forward_stop_signals() -> Iterator[None]:
    """While entered (in a launcher), SIGTERM, SIGUSR1 and SIGINT are passed on to this
    process's children, the ranks, which save at the end of their step and exit 0; the launcher
    then finishes as after any successful run. A second SIGINT is passed on too (the ranks
    abort) and ends the launcher with status 130, so that torchrun does not restart them. With
    no rank running (before they start, between restarts) the signal ends the launcher with
    status 128 + signal, as it would have."""
    interrupts = 0

    def forward(signum: int, frame) -> None:
        nonlocal interrupts
        children = child_pids()
        if not children:
            raise SystemExit(128 + signum)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        interrupts += signum == signal.SIGINT
        if interrupts > 1:
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, forward) for sig in handled()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class StepVerdict:
    """What every rank does after a step, the same on all of them. `nonfinite` names what was
    not finite on some rank ("loss", "grad_norm"); empty means the update is applied. `stop`:
    some rank was asked to stop, so the run saves after this step and exits. `writing`: some
    rank's checkpoint writer is still writing a save in flight (checkpoint.async), so the run
    does not complete that save yet."""

    nonfinite: tuple[str, ...] = ()
    stop: bool = False
    writing: bool = False

    @property
    def skip(self) -> bool:
        """No optimizer update for this step."""
        return bool(self.nonfinite)


def agree_on_step(
    loss: float | None,
    grad_norm: float,
    stop_requested: bool,
    ps: ParallelState,
    writing: bool = False,
) -> StepVerdict:
    """The StepVerdict of a step from this rank's view: its loss (None where this rank has no
    loss), the gradient norm, whether it was asked to stop and whether its checkpoint writer
    is still busy. Four fp32 flags, reduced (MAX)
    over the tp group, the dp x cp group and then the pp group, so over every rank: a rank
    that alone sees a NaN or a signal decides for all. (Two tiny all-reduces rather than one
    over the world: these groups take the shared-memory path on one host, the world does not.)"""
    local = [
        loss is not None and not math.isfinite(loss),
        not math.isfinite(grad_norm),
        stop_requested,
        writing,
    ]
    flags = torch.tensor(local, dtype=torch.float32, device=ps.device)
    comm.all_reduce(flags, ps.tp_group, op=dist.ReduceOp.MAX)
    comm.all_reduce(flags, ps.dp_cp_group, op=dist.ReduceOp.MAX)
    if ps.pp > 1:
        comm.all_reduce(flags, ps.pp_group, op=dist.ReduceOp.MAX)
    loss_bad, norm_bad, stop, still_writing = (bool(x) for x in flags.tolist())
    nonfinite = tuple(name for name, bad in (("loss", loss_bad), ("grad_norm", norm_bad)) if bad)
    return StepVerdict(nonfinite, stop, still_writing)


# --------------------------------------------------------------------------------------------
# Another rank failed


def lost_peer(exc: BaseException) -> str | None:
    """A short reason when exc says a collective failed because another rank went away (it
    exited, or did not come within parallel.timeout_s); None for any other error."""
    if isinstance(exc, (PeerLost, TimeoutError)):
        return str(exc)
    message = str(exc)
    if isinstance(exc, RuntimeError) and any(p in message for p in GLOO_PEER_ERRORS):
        first = message.strip().splitlines()[0]
        return first.split("] ", 1)[-1].split(". ", 1)[0]  # without gloo's source location
    return None
