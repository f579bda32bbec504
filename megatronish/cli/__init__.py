"""The `megatronish` command line: the click group assembled from the commands, each defined
beside the others of its kind (cli.data: prepare; cli.training: the commands that take a
config; cli.runs: those that read a run directory; cli.checkpoints: those that read a
checkpoint). Each command parses its options and calls one function of the package; a
UserError from there becomes one line on stderr and exit status 2, a RunFailure one line and
exit status 1 (cli.shared.user_errors)."""

from __future__ import annotations

import signal

import click

from megatronish.cli import checkpoints, data, runs, training
from megatronish.distributed import processes


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Megatron-style tensor-parallel GPT training."""


for command in (
    data.prepare,
    training.train,
    training.rl,
    training.check,
    training.launch,
    training.bench,
    training.plan,
    runs.plot,
    runs.diagnose,
    runs.trace,
    checkpoints.eval_command,
    checkpoints.generate,
    checkpoints.convert,
    checkpoints.export,
    checkpoints.import_command,
):
    cli.add_command(command)


def main() -> None:
    if processes.under_launcher():  # a rank: it must not outlive torchrun
        processes.die_with_parent()
    try:
        cli(prog_name="megatronish")
    finally:
        # The command is over and its exit status decided: a Ctrl-C now could only interrupt
        # an atexit callback (the checkpoint writer's, the process group's, tqdm's) into a
        # KeyboardInterrupt traceback. The process finishes its exit instead.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
