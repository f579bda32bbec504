"""A command in a process forked from the session's fork server (tests/ranks.py), handled as a
subprocess.Popen is: for the tests that signal, kill or wait for a `megatronish` command (or a
script that runs one) and read its exit status and files, without paying for a fresh
interpreter's imports of torch and megatronish each time.

``fork_popen([sys.executable, "-m", "megatronish", *args], stdout=..., stderr=...)`` runs
the command as subprocess.Popen would (``-m MODULE``, ``-c CODE`` or a script;
``fork_call(fn, *args, argv=...)``: a function, its return value the exit status) and gives a
Forked: pid, poll, wait, send_signal, kill, returncode. The
process is what a started interpreter would be where the tests look: its environment (env, as
Popen's: by default the caller's), working directory, argv, stdout and stderr (files, written
through as under PYTHONUNBUFFERED), signal dispositions (SIGINT raises KeyboardInterrupt;
SIGPIPE and SIGXFSZ ignored), a session of its own if asked, and its exit: non-daemon threads
joined, then the atexit callbacks, and the status of SystemExit (1 and a traceback for another
exception, death by SIGINT for an uncaught KeyboardInterrupt). torch computes on
OMP_NUM_THREADS threads (one where it is unset). The process ends by os._exit after the atexit
callbacks: the native teardown of a real interpreter's exit (static destructors) does not run.
What needs a real exec (the installed console script, an interpreter's own start-up, imports
or teardown, capabilities dropped for the new program) is left to subprocesses.
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.ranks import _context


def _redirect(fd: int, path: str | None) -> io.TextIOWrapper | None:
    """fd opened on path (None: left as it is); a text stream written through to it."""
    if path is None:
        return None
    file = os.open(path, os.O_WRONLY)  # made empty by fork_call
    os.dup2(file, fd)
    os.close(file)
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)


def _exit_status(fn: Callable, args: tuple) -> int:
    """fn(*args)'s exit status as the interpreter gives a program's."""
    try:
        result = fn(*args)
        return result if isinstance(result, int) else 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as Python reports an uncaught exception
        traceback.print_exc()
        return 1


def _process(fn, args, argv, environ, cwd, stdout, stderr, new_session, preexec_fn) -> None:
    """The forked process: set up as a started interpreter (see the module's docstring), runs
    fn(*args) and exits as the interpreter would."""
    os.chdir(cwd)  # in Popen's order: the directory, the session, then preexec_fn
    if new_session:
        os.setsid()
    if preexec_fn is not None:
        preexec_fn()
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = list(argv)
    sys.stdout = _redirect(1, stdout) or sys.stdout
    sys.stderr = _redirect(2, stderr) or sys.stderr
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    status = _exit_status(fn, args)
    threading._shutdown()  # as the interpreter exits: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if status < 0:  # an uncaught KeyboardInterrupt: the interpreter dies of SIGINT
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)


class Forked:
    """A forked command, as a subprocess.Popen: pid, args, returncode (negative: the signal
    that ended it), poll, wait, send_signal, terminate, kill."""

    def __init__(self, process, args: list[str]):
        self._process, self.args, self.pid = process, args, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; subprocess.TimeoutExpired if it runs on past timeout seconds."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_call(
    fn: Callable[..., Any],
    *args: Any,
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: str | Path | None = None,
    stderr: str | Path | None = None,
    start_new_session: bool = False,
    preexec_fn: Callable[[], None] | None = None,
) -> Forked:
    """fn(*args) in a forked process (the module's docstring) with sys.argv argv: its
    environment env (default: the caller's), in cwd (default: the caller's), stdout and stderr
    written to those files (None: the fork server's), in a session of its own with
    start_new_session, preexec_fn (picklable: a module's function, or a partial of one) called
    first. A capability dropped there stays effective: only an exec drops it."""
    environ = dict(os.environ if env is None else env)
    where = str(cwd or os.getcwd())
    outputs = [None if path is None else str(path) for path in (stdout, stderr)]
    for path in outputs:  # there, and empty, once the call returns
        if path is not None:
            open(path, "w").close()
    process = _context.Process(
        target=_process,
        args=(fn, args, argv, environ, where, *outputs, start_new_session, preexec_fn),
    )
    process.start()
    return Forked(process, argv)


def fork_popen(command: list[str], **options: Any) -> Forked:
    """command, `python -m MODULE ARGS`, `python -c CODE ARGS` or `python SCRIPT ARGS` (python:
    sys.executable), forked: the module, code or script run as __main__ with sys.argv as the
    interpreter would set it; options as fork_call's."""
    if len(command) < 2 or command[0] != sys.executable:
        raise ValueError(f"not a Python command: {command}")
    if command[1] in ("-m", "-c"):
        option, target, *args = command[1:]
        argv = [option if option == "-c" else target, *args]
        return fork_call(_run_main, option, target, argv=argv, **options)
    return fork_call(_run_main, "", command[1], argv=command[1:], **options)


def _run_main(option: str, target: str) -> None:
    """A module (option -m), code (-c) or script run as __main__."""
    if option == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif option == "-c":
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    else:
        runpy.run_path(target, run_name="__main__")


def fork_run(command: list[str], timeout: float, **options: Any) -> subprocess.CompletedProcess:
    """command forked (fork_popen) and waited for, as subprocess.run(command, timeout=timeout,
    capture_output=True, text=True) gives it; killed after timeout s (TimeoutExpired)."""
    with tempfile.TemporaryDirectory() as directory:
        stdout, stderr = Path(directory) / "stdout", Path(directory) / "stderr"
        proc = fork_popen(command, stdout=stdout, stderr=stderr, **options)
        try:
            status = proc.wait(timeout)
        finally:
            proc.kill()
            proc.wait()
        outputs = [path.read_text(errors="replace") for path in (stdout, stderr)]
    return subprocess.CompletedProcess(command, status, *outputs)
