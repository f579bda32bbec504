"""The commands that take a config (--config, --set): train, rl, launch, check, bench and
plan."""

from __future__ import annotations

import functools
import sys

import click

from megatronish.cli.shared import config_option, set_option, user_errors
from megatronish.config import load_config


@click.command()
@config_option
@set_option
@user_errors
def train(config_path, overrides):
    """Train; one process per rank under torchrun, or a single process when the world is 1."""
    from megatronish.errors import UserError
    from megatronish.training.trainer import train as run_training

    try:
        cfg = load_config(config_path, overrides)
    except UserError as exc:  # the same on every rank of a torchrun: said once, by rank 0
        exc.rank0_prints = True
        raise
    run_training(cfg)


@click.command()
@config_option
@set_option
@user_errors
def rl(config_path, overrides):
    """The built-in GRPO run (adding two small numbers): SFT, then GRPO with rollouts from
    generate; metrics.jsonl logs each step's mean reward."""
    from megatronish.rl.grpo import run_rl

    run_rl(config_path, list(overrides))


@click.command()
@config_option
@set_option
@click.option("--world-size", type=int, default=None, help="Processes to check the layout for.")
@user_errors
def check(config_path, overrides, world_size):
    """Validate a config without starting anything; print it resolved with its derived sizes."""
    from megatronish.commands.check import check_config

    note = functools.partial(click.echo, err=True)
    click.echo(check_config(load_config(config_path, overrides), world_size, note))


@click.command()
@config_option
@set_option
@click.option("--nnodes", type=int, default=1, show_default=True, help="Number of nodes.")
@click.option("--node-rank", type=int, default=0, show_default=True, help="This node's rank.")
@click.option(
    "--rdzv-endpoint",
    default="127.0.0.1:29500",
    show_default=True,
    help="HOST:PORT of the rendezvous (node 0's address) for multi-node runs.",
)
@click.option(
    "--rdzv-timeout",
    type=int,
    default=600,
    show_default=True,
    help="Seconds for the nodes to meet, and for node 0's endpoint to answer.",
)
@click.option("--max-restarts", type=int, default=0, show_default=True)
@click.option(
    "--command",
    type=click.Choice(["train", "rl"]),
    default="train",
    show_default=True,
    help="The command the ranks run: train, or rl (the built-in GRPO run).",
)
@user_errors
def launch(
    config_path, overrides, nnodes, node_rank, rdzv_endpoint, rdzv_timeout, max_restarts, command
):
    """Start `train` (or --command rl) through torchrun with processes per node from the
    parallel degrees."""
    from megatronish.commands.launch import launch as run_launch

    cfg = load_config(config_path, overrides)
    args = (nnodes, node_rank, rdzv_endpoint, max_restarts, rdzv_timeout, command)
    sys.exit(run_launch(cfg, config_path, overrides, *args))


@click.command()
@config_option
@set_option
@click.option("--steps", type=int, default=10, show_default=True, help="Timed training steps.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed steps first.")
@user_errors
def bench(config_path, overrides, steps, warmup):
    """Time training steps; the last line is one JSON object with tokens_per_s, step_time_s,
    mfu and the bytes each rank sends per step (counted and by the analytic formula)."""
    from megatronish.commands.bench import bench as run_bench

    sys.exit(run_bench(config_path, overrides, steps, warmup))


@click.command()
@config_option
@set_option
@click.option("--gpus", type=int, default=None, help="GPUs to plan for (default: the config's).")
@click.option(
    "--gpu",
    default=None,
    help="GPU model: H100 (default), H200, A100, B200, ...; or a YAML file describing one.",
)
@click.option(
    "--cluster",
    default=None,
    help="The nodes and network: dgx-a100-selene, dgx-h100, dgx-b200, grand-teton-h100-roce, "
    "pcie-l40s; or a YAML file describing one (default: the GPU's own nodes).",
)
@click.option(
    "--gpu-memory", type=float, default=None, help="Memory per GPU in GiB (default: the GPU's)."
)
@click.option(
    "--layout",
    default=None,
    help='One layout to predict instead of searching, e.g. "tp=8 pp=8 v=2 cp=1 dp=24".',
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--device",
    type=click.Choice(["gpu", "cpu"]),
    default="gpu",
    show_default=True,
    help="cpu: measure this host and plan CPU processes (--gpus is the process count).",
)
@click.option(
    "--calibration",
    default=None,
    help="With --device cpu: a calibration JSON to read, or to write after measuring.",
)
@click.option(
    "--show",
    type=int,
    default=12,
    show_default=True,
    help="Fastest fitting layouts to list (0: every one that fits).",
)
@user_errors
def plan(
    config_path,
    overrides,
    gpus,
    gpu,
    cluster,
    gpu_memory,
    layout,
    as_json,
    device,
    calibration,
    show,
):
    """Per-rank memory, predicted step time and the fastest layout that fits, without starting
    anything."""
    from megatronish.commands.plan import plan as make_plan

    cfg = load_config(config_path, overrides)
    text = make_plan(
        cfg, gpus, gpu, gpu_memory, layout, as_json, device, calibration, show, cluster
    )
    click.echo(text)
