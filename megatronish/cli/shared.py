"""What the commands share: the error handling that turns a ReportedError into one line and its
exit status, and the options several commands take (--config, --set, --checkpoint)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

import click

from megatronish.errors import ReportedError

RANK0_GRACE_S = 10.0
"""How long a rank other than 0 waits, under torchrun, before exiting with an error rank 0 prints:
torchrun stops every rank as soon as one exits with an error, so a rank that left first could
stop rank 0 before it printed the line. Rank 0's exit ends the wait (torchrun stops the rest)."""


def _leave_rank0_time_to_print() -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent
        with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C ends the wait, no traceback
            time.sleep(RANK0_GRACE_S)


def user_errors(fn):
    """Turns a ReportedError into `error: <message>` (`aborted: ...`) on stderr and its exit
    status, and a Ctrl-C the command did not handle into `aborted: Ctrl-C` and 130; one raised
    alike on every rank (rank0_prints, Ctrl-C) is printed by global rank 0 only."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rank0 = os.environ.get("RANK", "0") == "0"
        try:
            return fn(*args, **kwargs)
        except ReportedError as exc:
            if not exc.rank0_prints or rank0:
                click.echo(f"{exc.label}: {exc}", err=True)
            else:
                _leave_rank0_time_to_print()
            sys.exit(exc.exit_status)
        except KeyboardInterrupt:  # e.g. train before the run turns Ctrl-C into a stop request
            if rank0:
                click.echo("aborted: Ctrl-C", err=True)
            sys.exit(130)

    return wrapper


config_option = click.option(
    "--config", "config_path", required=True, help="YAML config file (see configs/)."
)
set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key by its dotted name, e.g. --set train.steps=20 (repeatable).",
)
checkpoint_option = click.option(
    "--checkpoint",
    "checkpoint_path",
    required=True,
    help="A checkpoint: a step directory, or a checkpoint.dir (its newest complete checkpoint).",
)
