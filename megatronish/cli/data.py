"""`megatronish prepare`: a training dataset from text, JSON Lines or chat examples, or a
Megatron indexed dataset converted to and from one."""

from __future__ import annotations

import click

from megatronish.cli.shared import user_errors


@click.command()
@click.option(
    "--input", "inputs", multiple=True, help="File, directory or .jsonl file (repeatable)."
)
@click.option(
    "--tokenizer",
    default="byte",
    show_default=True,
    help="byte | bpe | a tokenizer.json | a Hugging Face tokenizer directory (--sft: its chat "
    "template renders the records).",
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
@click.option(
    "--preference",
    is_flag=True,
    help="Inputs are JSON Lines of {messages or prompt, chosen, rejected}: pairs for DPO.",
)
@click.option("--output", required=True, help="Directory (or Megatron prefix) to write to.")
@user_errors
def prepare(
    inputs,
    tokenizer,
    vocab_size,
    glob_pattern,
    jsonl_field,
    val_fraction,
    seed,
    output_format,
    eod_id,
    sft,
    preference,
    output,
):
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
        preference=preference,
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
    if meta.get("preference"):
        click.echo(_preference_line(meta))
    elif meta.get("sft"):
        click.echo(_sft_line(meta))
    for note in prepare_notes(meta):
        click.echo(note)


def _sft_line(meta: dict) -> str:
    counted = (
        f"the assistant messages as {meta['chat_template_source']} writes them"
        if meta.get("chat_template")
        else "the responses and their end-of-text tokens"
    )
    return (
        f"sft: {meta['counted_tokens']:,} of the {meta['n_tokens']:,} tokens ({counted}) count "
        "in the loss"
    )


def _preference_line(meta: dict) -> str:
    return (
        f"preference: {meta['preference']['pairs']:,} pairs (chosen and rejected conversations "
        f"sharing their prompt); {meta['counted_tokens']:,} response tokens count"
    )
