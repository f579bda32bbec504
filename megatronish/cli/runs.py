"""The commands that read a run directory: plot, diagnose and trace."""

from __future__ import annotations

import sys

import click

from megatronish.cli.shared import user_errors


@click.command()
@click.argument("run_dir")
@click.option("--output", default=None, help="PNG to write (default: RUN_DIR/curves.png).")
@user_errors
def plot(run_dir, output):
    """Loss, learning rate and throughput curves from a run's metrics.jsonl."""
    from megatronish.commands.plot import plot_run
    from megatronish.paths import require_output_file

    if output is not None:
        require_output_file(output, "--output")
    click.echo(plot_run(run_dir, output))


@click.command()
@click.argument("run_dir")
def diagnose(run_dir):
    """Read the ranks' flight-recorder dumps (RUN_DIR/debug/rank_*.json) of a hung or failed
    run and name the rank the others wait for, the collective, its group and sequence number."""
    from megatronish.commands.diagnose import diagnose_run

    text, status = diagnose_run(run_dir)
    click.echo(text, err=status != 0)
    sys.exit(status)


@click.command()
@click.argument("run_dir")
@click.option(
    "--output", default=None, help="Merged trace to write (default: RUN_DIR/traces/merged.json)."
)
@user_errors
def trace(run_dir, output):
    """Merge the ranks' profiler traces into one trace (a process per rank) and print compute,
    exposed communication and bubble per rank."""
    from megatronish.commands.trace import merge_traces
    from megatronish.paths import require_output_file

    if output is not None:
        require_output_file(output, "--output")
    text, status = merge_traces(run_dir, output)
    click.echo(text)
    sys.exit(status)
