"""The `megatronish` command line. Each command parses its options and calls one function of the
package; a UserError from there becomes one line on stderr and exit status 2, a RunFailure one
line and exit status 1."""

from __future__ import annotations

import functools
import os
import sys

import click

from megatronish.config import load_config
from megatronish.distributed import processes
from megatronish.errors import ReportedError


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
            sys.exit(exc.exit_status)
        except KeyboardInterrupt:  # e.g. train before the run turns Ctrl-C into a stop request
            if rank0:
                click.echo("aborted: Ctrl-C", err=True)
            sys.exit(130)

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
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="Vocab size of a trained BPE tokenizer, or of a Megatron prefix --input.",
)
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
@click.option(
    "--output-format",
    type=click.Choice(["megatronish", "megatron"]),
    default="megatronish",
    show_default=True,
    help="megatron: write --output PREFIX as PREFIX.bin + PREFIX.idx (Megatron indexed dataset).",
)
@click.option(
    "--eod-id", type=int, default=None, help="End-of-document id of a Megatron prefix --input."
)
@click.option(
    "--sft",
    is_flag=True,
    help="Inputs are JSON Lines of prompt/response or messages; store a loss mask (responses).",
)
@click.option("--output", required=True, help="Directory (or Megatron prefix) to write to.")
@user_errors
def prepare(
    inputs, tokenizer, vocab_size, glob_pattern, jsonl_field, val_fraction, seed, output_format,
    eod_id, sft, output,
):  # fmt: skip
    """Tokenize text into a training dataset (default input: the Python standard library); or
    convert a Megatron indexed dataset (--input PREFIX.idx) to and from one; --sft: chat
    examples with a loss mask."""
    from megatronish.data import read_metadata
    from megatronish.data.convert import prepare_any
    from megatronish.data.prepare import prepare_notes
    from megatronish.paths import require_output_dir

    if output_format == "megatronish":
        require_output_dir(output, "--output")
    path = prepare_any(
        inputs=list(inputs),
        output=output,
        output_format=output_format,
        vocab_size=vocab_size,
        eod_id=eod_id,
        tokenizer=tokenizer,
        glob_pattern=glob_pattern,
        jsonl_field=jsonl_field,
        val_fraction=val_fraction,
        seed=seed,
        sft=sft,
    )
    if output_format == "megatron":
        from megatronish.data.indexed import read_indexed

        data = read_indexed(path)
        click.echo(
            f"wrote {path}.bin + {path}.idx: {len(data.tokens):,} tokens in {data.n_docs:,} "
            f"documents ({data.tokens.dtype.name})"
        )
        return
    meta = read_metadata(path)
    click.echo(
        f"wrote {path}: {meta['n_tokens']:,} tokens in {meta['n_docs']:,} documents "
        f"({meta['val_docs']:,} for validation), {meta['tokenizer']['kind']} tokenizer, "
        f"vocab {meta['vocab_size']:,}"
    )
    if meta.get("sft"):
        click.echo(
            f"sft: {meta['counted_tokens']:,} of the {meta['n_tokens']:,} tokens (the responses "
            "and their end-of-text tokens) count in the loss"
        )
    for note in prepare_notes(meta):
        click.echo(note)


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
    from megatronish.errors import UserError
    from megatronish.training.trainer import train as run_training

    try:
        cfg = load_config(config_path, overrides)
    except UserError as exc:  # the same on every rank of a torchrun: said once, by rank 0
        exc.rank0_prints = True
        raise
    run_training(cfg)


@cli.command()
@config_option
@set_option
@click.option("--world-size", type=int, default=None, help="Processes to check the layout for.")
@user_errors
def check(config_path, overrides, world_size):
    """Validate a config without starting anything; print it resolved with its derived sizes."""
    from megatronish.commands.check import check_config

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
@click.option("--rdzv-timeout", type=int, default=600, help="Seconds for the nodes to meet (600).")
@click.option("--max-restarts", type=int, default=0, show_default=True)
@user_errors
def launch(config_path, overrides, nnodes, node_rank, rdzv_endpoint, rdzv_timeout, max_restarts):
    """Start `train` through torchrun with processes per node from the parallel degrees."""
    from megatronish.commands.launch import launch as run_launch

    cfg = load_config(config_path, overrides)
    args = (nnodes, node_rank, rdzv_endpoint, max_restarts, rdzv_timeout)
    sys.exit(run_launch(cfg, config_path, overrides, *args))


@cli.command()
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


@cli.command()
@config_option
@set_option
@click.option("--gpus", type=int, default=None, help="GPUs to plan for (default: the config's).")
@click.option(
    "--gpu", default=None,
    help="GPU model: H100 (default), H200, A100, B200, ...; or a YAML file describing one.",
)  # fmt: skip
@click.option(
    "--gpu-memory", type=float, default=None, help="Memory per GPU in GiB (default: the GPU's)."
)
@click.option(
    "--layout", default=None,
    help='One layout to predict instead of searching, e.g. "tp=8 pp=8 v=2 cp=1 dp=24".',
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--device", type=click.Choice(["gpu", "cpu"]), default="gpu", show_default=True,
    help="cpu: measure this host and plan CPU processes (--gpus is the process count).",
)  # fmt: skip
@click.option(
    "--calibration", default=None,
    help="With --device cpu: a calibration JSON to read, or to write after measuring.",
)  # fmt: skip
@click.option(
    "--show", type=int, default=12, show_default=True,
    help="Fastest fitting layouts to list (0: every one that fits).",
)  # fmt: skip
@user_errors
def plan(config_path, overrides, gpus, gpu, gpu_memory, layout, as_json, device, calibration, show):
    """Per-rank memory, predicted step time and the fastest layout that fits, without starting
    anything."""
    from megatronish.commands.plan import plan as make_plan

    cfg = load_config(config_path, overrides)
    text = make_plan(cfg, gpus, gpu, gpu_memory, layout, as_json, device, calibration, show)
    click.echo(text)


@cli.command()
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


@cli.command()
@click.argument("run_dir")
def diagnose(run_dir):
    """Read the ranks' flight-recorder dumps (RUN_DIR/debug/rank_*.json) of a hung or failed
    run and name the rank the others wait for, the collective, its group and sequence number."""
    from megatronish.commands.diagnose import diagnose_run

    text, status = diagnose_run(run_dir)
    click.echo(text, err=status != 0)
    sys.exit(status)


@cli.command()
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


checkpoint_option = click.option(
    "--checkpoint", "checkpoint_path", required=True,
    help="A checkpoint: a step directory, or a checkpoint.dir (its newest complete checkpoint).",
)  # fmt: skip


@cli.command("eval")
@checkpoint_option
@set_option
@user_errors
def eval_command(checkpoint_path, overrides):
    """Validation loss and perplexity of a checkpoint; the last line is one JSON object."""
    import json

    from megatronish.inference.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(checkpoint_path, overrides)
    click.echo(
        f"step {result['step']}: val_loss {result['val_loss']:.4f}, perplexity "
        f"{result['perplexity']:.2f} ({result['tokens']:,} tokens of {result['dataset']})"
    )
    click.echo(json.dumps(result))


@cli.command()
@checkpoint_option
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=int, default=200, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0: no limit.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass.")
@click.option("--seed", type=int, default=1234, show_default=True)
@user_errors
def generate(checkpoint_path, prompt, max_new_tokens, temperature, top_k, top_p, seed):
    """Continue a prompt, streaming the text as it is sampled (under torchrun: at tp = ranks)."""
    from megatronish.distributed.layout import world_size_from_env
    from megatronish.inference.generate import Sampling, generate_text

    main_rank = os.environ.get("RANK", "0") == "0"  # torchrun's global rank

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    sampling = Sampling(temperature, top_k, top_p)
    reason = generate_text(checkpoint_path, prompt, max_new_tokens, sampling, seed, write)
    if main_rank:
        write("\n")
        why = {
            "eot": "end of text",
            "max_new_tokens": f"--max-new-tokens {max_new_tokens}",
            "max_seq_len": "the model's max_seq_len (its context is full)",
        }[reason]
        ranks = world_size_from_env()
        click.echo(f"[stopped at {why}; tp {ranks}]", err=True)


@cli.command()
@checkpoint_option
@click.option("--tp", type=int, required=True, help="Tensor-parallel degree to re-shard to.")
@click.option("--output", required=True, help="New checkpoint directory.")
@user_errors
def convert(checkpoint_path, tp, output):
    """Re-shard a checkpoint to another tensor-parallel degree (one process)."""
    from megatronish.checkpoint.convert import convert_checkpoint

    click.echo(f"wrote {convert_checkpoint(checkpoint_path, tp, output)} (tp {tp})")


@cli.command()
@checkpoint_option
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True)
@click.option("--output", required=True, help="Directory to write.")
@user_errors
def export(checkpoint_path, fmt, output):
    """A Hugging Face directory (config.json + model.safetensors) that transformers loads."""
    from megatronish.hf.exporter import export_hf

    for line in export_hf(checkpoint_path, output):
        click.echo(line)


@cli.command("import")
@click.option("--hf", "hf_dir", required=True, help="Hugging Face directory (gpt2 or llama).")
@click.option("--output", required=True, help="Checkpoint directory to write.")
@set_option
@user_errors
def import_command(hf_dir, output, overrides):
    """A checkpoint (step 0, weights only) of a Hugging Face GPT-2 or Llama directory."""
    from megatronish.hf.importer import import_hf

    step_dir, has_tokenizer = import_hf(hf_dir, output, overrides)
    click.echo(f"wrote {step_dir}" + ("" if has_tokenizer else " (no tokenizer found)"))


def main() -> None:
    if processes.under_launcher():  # a rank: it must not outlive torchrun
        processes.die_with_parent()
    cli(prog_name="megatronish")
