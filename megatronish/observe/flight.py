"""Hang reports: every rank writes its flight recorder and thread stacks to
<run.out_dir>/debug/rank_R.json when one of its operations has been in flight too long, when any
rank asks for it, or on SIGUSR2; `megatronish diagnose` reads them (megatronish.commands.diagnose).

A rank whose operation times out, or that gets SIGUSR2, also writes <run.out_dir>/debug/
DUMP_REQUESTED; every rank watches for that file (ranks share out_dir on one host or on a shared
filesystem) and dumps once for each new request, so the ranks that are not waiting in a
collective (the ones the others wait for) dump too. The watching is done by a daemon thread,
which does not need the training thread: it dumps a rank blocked in a collective, in user code
or in a signal-free C call alike. SIGUSR2 reaches that thread through the signal module's wakeup
fd, because the Python-level handler of a signal only runs once the main thread is back in
Python, which a rank stuck in a collective never is.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from megatronish.files import write_text_atomic
from megatronish.observe.record import RECORDER

TRIGGER = "DUMP_REQUESTED"
_IMPORTED = time.time()
_DUMPING = ("dump", "thread_stacks")  # the frames of a dump in progress


def dump(out_dir: str | Path, rank: int, reason: str, world_size: int | None = None) -> Path:
    """Writes this rank's report to <out_dir>/debug/rank_{rank}.json (atomically) and returns
    its path: pid, reason, time, world size (the default group's when not given and one is
    initialized; else null), the recorded entries, the oldest in-flight one (or null) and the
    stack of every thread, the main thread's first."""
    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    entries = RECORDER.snapshot()
    report = {
        "rank": rank,
        "pid": os.getpid(),
        "reason": reason,
        "time": time.time(),
        "world_size": world_size,
        "entries": entries,
        "in_flight": next((e for e in entries if e["end"] is None), None),
        "stacks": thread_stacks(),
    }
    path = Path(out_dir) / "debug" / f"rank_{rank}.json"
    _write_atomic(path, json.dumps(report, indent=1))
    return path


def thread_stacks() -> list[dict]:
    """[{"thread": name, "stack": text}] for every thread, the main thread first; the frames of
    the dump itself are left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    stacks = []
    for ident in sorted(frames, key=lambda i: i != main):
        summary = traceback.extract_stack(frames[ident])
        while summary and summary[-1].filename == __file__ and summary[-1].name in _DUMPING:
            summary.pop()
        stack = "".join(traceback.format_list(summary))
        stacks.append({"thread": names.get(ident, f"thread {ident}"), "stack": stack})
    return stacks


def _write_atomic(path: Path, text: str) -> None:
    """path <- text, through a temporary file in the same directory: a reader sees the old
    file or the whole new one. Its mode follows the umask, as every file of a run does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def process_start() -> float:
    """When this process started (time.time() scale, to about a second) from /proc; where there
    is no /proc, when this module was imported."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


class Watchdog:
    """Dumps this rank's report (see the module docstring) from a daemon thread that looks
    every poll_s seconds. Its own timeout fires once per in-flight operation, and not for one
    that an earlier dump already caught in flight; a request from another rank is answered
    once. Between start() and close(), SIGUSR2 dumps this rank and asks every rank to."""

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        world_size: int,
        timeout_s: float,
        poll_s: float = 0.5,
    ):
        self.out_dir, self.rank, self.world_size = Path(out_dir), rank, world_size
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.debug = self.out_dir / "debug"
        self.started_at = process_start()
        self.last_dump = 0.0  # time.time() of this rank's last dump
        self._answered: set[str] = set()  # the requests (trigger texts) already dumped for
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._signal: tuple | None = None  # (previous SIGUSR2 handler, previous wakeup fd)
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Removes this rank's dump (and on rank 0 the request) left by an earlier run, installs
        the SIGUSR2 handler when called from the main thread, starts watching; returns self.
        Creates nothing: the debug directory comes with the first dump."""
        stale = [self.debug / f"rank_{self.rank}.json"]
        if self.rank == 0:
            stale.append(self.debug / TRIGGER)
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < self.started_at:
                    path.unlink()
        if threading.current_thread() is threading.main_thread():
            # The handler only keeps SIGUSR2 from ending the process; the dump is the thread's.
            previous = signal.signal(signal.SIGUSR2, lambda signum, frame: None)
            fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
            self._signal = (previous, fd)
        self._thread = threading.Thread(target=self._run, name="megatronish-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops watching and restores SIGUSR2's handler and the wakeup fd (call it from the
        thread that called start()); idempotent."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._signal is not None:
            previous, fd = self._signal
            signal.set_wakeup_fd(fd)
            signal.signal(signal.SIGUSR2, signal.SIG_DFL if previous is None else previous)
            self._signal = None
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        previous_fd = self._signal[1] if self._signal is not None else -1
        while not self._stop.is_set():
            ready, _, _ = select.select([self._wake_r], [], [], self.poll_s)
            signals = b""
            if ready:
                with contextlib.suppress(BlockingIOError):
                    signals = self._wake_r.recv(4096).replace(b"\0", b"")
                if previous_fd >= 0 and signals:  # whoever had the wakeup fd still gets them
                    with contextlib.suppress(OSError):
                        os.write(previous_fd, signals)
            if self._stop.is_set():
                return
            try:
                self._check(signal.SIGUSR2 in signals)
            except OSError as e:
                print(f"rank {self.rank}: could not write the hang report: {e}", file=sys.stderr)

    def _check(self, signalled: bool) -> None:
        if signalled:
            self._dump_and_request("SIGUSR2")
            return
        request = self._request()
        if request is not None and request not in self._answered:
            self._answered.add(request)
            try:
                asked = json.loads(request)
                reason = f"rank {asked['rank']}: {asked['reason']}"
            except (ValueError, KeyError, TypeError):
                reason = request.strip()
            self._dump(f"asked by another rank: {reason}")
            return
        entry = RECORDER.oldest_in_flight()
        if entry is None or time.time() - entry.start <= self.timeout_s:
            return
        if self.last_dump > entry.start:  # dumped already while it hangs
            return
        self._dump_and_request(
            f"{entry.op} #{entry.seq} on {entry.group} in flight for more than {self.timeout_s} s"
        )

    def _request(self) -> str | None:
        """The text of the dump request now in the debug dir, unless it predates this process."""
        path = self.debug / TRIGGER
        try:
            if path.stat().st_mtime < self.started_at:
                return None
            return path.read_text()
        except FileNotFoundError:
            return None

    def _dump(self, reason: str) -> None:
        self.last_dump = time.time()
        dump(self.out_dir, self.rank, reason, self.world_size)

    def _dump_and_request(self, reason: str) -> None:
        self._dump(reason)
        request = json.dumps(
            {"rank": self.rank, "pid": os.getpid(), "time": time.time(), "reason": reason}
        )
        self._answered.add(request)
        _write_atomic(self.debug / TRIGGER, request)


def watchdog_for(cfg, ps) -> Watchdog | None:
    """The run's started watchdog (cfg: megatronish.config.Config, ps: ParallelState), or None
    when observe.flight_recorder is 0. Sizes the flight recorder to observe.flight_recorder (and
    clears it). An operation counts as hung a minute before parallel.timeout_s would fail it
    (at half of it when that is under two minutes), so every rank dumps before the run exits."""
    RECORDER.resize(cfg.observe.flight_recorder)
    if not cfg.observe.flight_recorder:
        return None
    timeout_s = cfg.parallel.timeout_s
    hung_after = max(timeout_s - 60.0, timeout_s / 2)
    return Watchdog(cfg.run.out_dir, ps.rank, ps.world_size, hung_after).start()
