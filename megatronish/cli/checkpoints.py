"""The commands that read a checkpoint: eval, generate, convert, export, and import (which
writes one from a Hugging Face directory)."""

from __future__ import annotations

import os
import sys

import click

from megatronish.cli.shared import checkpoint_option, set_option, user_errors


@click.command("eval")
@checkpoint_option
@set_option
@user_errors
def eval_command(checkpoint_path, overrides):
    """Validation loss and perplexity of a checkpoint (of a DPO run on its pairs: the DPO loss
    and rewards); the last line is one JSON object."""
    import json

    from megatronish.inference.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(checkpoint_path, overrides)
    if "pairs" in result:  # a DPO run's checkpoint on its preference pairs
        counted = f"accuracy {result['val_rewards/accuracies']:.3f} ({result['pairs']:,} pairs"
    else:
        counted = f"perplexity {result['perplexity']:.2f} ({result['tokens']:,} tokens"
    loss = f"val_loss {result['val_loss']:.4f}"
    click.echo(f"step {result['step']}: {loss}, {counted} of {result['dataset']})")
    click.echo(json.dumps(result))


@click.command()
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
    generation = generate_text(checkpoint_path, prompt, max_new_tokens, sampling, seed, write)
    if main_rank:
        write("\n")
        why = {
            "eot": "end of text",
            "max_new_tokens": f"--max-new-tokens {max_new_tokens}",
            "max_seq_len": "the model's max_seq_len (its context is full)",
        }[generation.stop_reason]
        ranks = world_size_from_env()
        click.echo(f"[stopped at {why}; tp {ranks}; {cache_report(generation)}]", err=True)


def cache_report(generation) -> str:
    """What generate's decode cache holds on a rank: bytes per token of the layers whose cache
    grows, and the bytes fixed at any length of the linear-attention layers (model.layer_types)."""
    fixed, growing = generation.cache_bytes()
    line = f"decode cache per rank {sum(growing):,} bytes per token"
    if growing:
        line += f" ({growing[0]:,} per layer x {len(growing)})"
    if fixed:
        linear = len(generation.cache) - len(growing)
        line += f" + {fixed:,} bytes fixed (state and convolution tail; linear layers: {linear})"
    return line


@click.command()
@checkpoint_option
@click.option("--tp", type=int, required=True, help="Tensor-parallel degree to re-shard to.")
@click.option("--output", required=True, help="New checkpoint directory.")
@user_errors
def convert(checkpoint_path, tp, output):
    """Re-shard a checkpoint to another tensor-parallel degree (one process)."""
    from megatronish.checkpoint.convert import convert_checkpoint

    click.echo(f"wrote {convert_checkpoint(checkpoint_path, tp, output)} (tp {tp})")


@click.command()
@checkpoint_option
@click.option("--format", "fmt", type=click.Choice(["hf", "peft"]), default="hf", show_default=True)
@click.option("--output", required=True, help="Directory to write.")
@click.option("--merge-lora", is_flag=True, help="hf: the LoRA adapters merged into the weights.")
@user_errors
def export(checkpoint_path, fmt, output, merge_lora):
    """A Hugging Face directory (config.json + model.safetensors) that transformers loads as the
    model's family: GPT-2, Llama 2/3.x, Mistral, Mixtral, Qwen2/2.5, Qwen3, Qwen3-MoE, Qwen3.5,
    Qwen3.5-MoE, Qwen3-Next, DeepSeek-V3, Gemma 3 or GPT-OSS (its experts unquantized); of a
    LoRA run (model.lora) with --merge-lora, or
    with --format peft its adapter, which peft.PeftModel.from_pretrained loads."""
    from megatronish.errors import UserError

    if fmt == "peft":
        if merge_lora:
            raise UserError("--merge-lora: only with --format hf (peft writes the adapter alone)")
        from megatronish.hf.exporter import export_peft

        lines = export_peft(checkpoint_path, output)
    else:
        from megatronish.hf.exporter import export_hf

        lines = export_hf(checkpoint_path, output, merge_lora)
    for line in lines:
        click.echo(line)


@click.command("import")
@click.option(
    "--hf",
    "hf_dir",
    required=True,
    help="Hugging Face directory (GPT-2, Llama 2/3.x, Mistral, Mixtral, Qwen2/2.5, Qwen3, "
    "Qwen3-MoE, Qwen3.5, Qwen3.5-MoE, Qwen3-Next, DeepSeek-V3, Gemma 3, GPT-OSS with MXFP4 or "
    "plain experts).",
)
@click.option("--output", required=True, help="Checkpoint directory to write.")
@set_option
@user_errors
def import_command(hf_dir, output, overrides):
    """A checkpoint (step 0, weights only) of a Hugging Face model directory. Its config.json
    decides the model: --set takes the other keys (data.path, train.*), no model.* key."""
    from megatronish.hf.importer import import_hf

    step_dir, has_tokenizer = import_hf(hf_dir, output, overrides)
    click.echo(f"wrote {step_dir}" + ("" if has_tokenizer else " (no tokenizer found)"))
