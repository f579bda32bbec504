"""The `megatronish` command line. Each command parses its options and calls one function of the
package; a UserError from there becomes one line on stderr and exit status 2."""

from __future__ import annotations

import functools
import sys

import click

from megatronish.config import load_config
from megatronish.errors import UserError


def user_errors(fn):
    """Turns a UserError into `error: <message>` on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Megatron-style tensor-parallel GPT training."""


@cli.command()
@click.option(
    "--input", "inputs", multiple=True, help="File, directory or .jsonl file (repeatable)."
)
@click.option(
    "--tokenizer", default="byte", show_default=True, help="byte | bpe | path to a tokenizer.json."
)
@click.option("--vocab-size", type=int, default=None, help="Vocab size of a trained BPE tokenizer.")
@click.option(
    "--glob",
    "glob_pattern",
    default=None,
    help="Files to take from input directories, e.g. '*.txt'.",
)
@click.option(
    "--jsonl-field", default="text", show_default=True, help="Field of each JSON Lines record."
)
@click.option(
    "--val-fraction",
    type=float,
    default=0.01,
    show_default=True,
    help="Share of documents held out.",
)
@click.option(
    "--seed", type=int, default=1234, show_default=True, help="Seed of the train/validation split."
)
@click.option("--output", required=True, help="Directory to write the dataset to.")
@user_errors
def prepare(inputs, tokenizer, vocab_size, glob_pattern, jsonl_field, val_fraction, seed, output):
    """Tokenize text into a training dataset (default input: the Python standard library)."""
    from megatronish.data import prepare_dataset

    prepare_dataset(
        inputs=list(inputs),
        output=output,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        glob_pattern=glob_pattern,
        jsonl_field=jsonl_field,
        val_fraction=val_fraction,
        seed=seed,
    )


config_option = click.option(
    "--config", "config_path", required=True, help="YAML config file (see configs/)."
)
set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a config key by its dotted name, e.g. --set train.steps=20 (repeatable).",
)  # fmt: skip


@cli.command()
@config_option
@set_option
@user_errors
def train(config_path, overrides):
    """Train; one process per rank under torchrun, or a single process when the world is 1."""
    from megatronish.trainer import train as run_training

    run_training(load_config(config_path, overrides))


@cli.command()
@config_option
@set_option
@click.option("--world-size", type=int, default=None, help="Processes to check the layout for.")
@user_errors
def check(config_path, overrides, world_size):
    """Validate a config without starting anything; print it resolved with its derived sizes."""
    from megatronish.check import check_config

    click.echo(check_config(load_config(config_path, overrides), world_size))


@cli.command()
@config_option
@set_option
@click.option("--nnodes", type=int, default=1, show_default=True, help="Number of nodes.")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This node's rank.")
@click.option(
    "--rdzv-endpoint", default="127.0.0.1:29500", show_default=True,
    help="HOST:PORT of the rendezvous (node 0's address) for multi-node runs.",
)  # fmt: skip
@click.option("--max-restarts", type=int, default=0, show_default=True)
@user_errors
def launch(config_path, overrides, nnodes, node_rank, rdzv_endpoint, max_restarts):
    """Start `train` through torchrun with processes per node from the parallel degrees."""
    from megatronish.launch import launch as run_launch

    cfg = load_config(config_path, overrides)
    sys.exit(
        run_launch(cfg, config_path, overrides, nnodes, node_rank, rdzv_endpoint, max_restarts)
    )


@cli.command()
@config_option
@set_option
@click.option("--steps", type=int, default=10, show_default=True, help="Timed training steps.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed steps first.")
@user_errors
def bench(config_path, overrides, steps, warmup):
    """Time training steps; the last line is one JSON object with tokens_per_s, step_time_s,
    mfu and the bytes each rank sends per step (counted and by the analytic formula)."""
    from megatronish.bench import bench as run_bench

    sys.exit(run_bench(config_path, overrides, steps, warmup))


def main() -> None:
    cli(prog_name="megatronish")
