"""Data pipeline throughput on the built-in corpus (the standard library's .py files).

    python scripts/bench_data.py [--repeats 3] [--vocab-size 8192] [--steps 200]

Prints a table: prepare throughput in MB/s (UTF-8 text bytes / wall seconds, file discovery,
reading and writing included) for the byte tokenizer and for BPE, with BPE training timed apart
from encoding; and the loader's time per batch (micro-batch 8, seq_len 1024) in microseconds.
Byte and loader rows are the best of --repeats runs; BPE rows run once (they take seconds).
The cpu column is the process's CPU time over all threads: on a shared machine, MB/s falls
when other work takes the cores, while cpu stays close to the work done.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from megatronish.data import BatchLoader, prepare_dataset, read_metadata


def timed_prepare(output: Path, **kwargs) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of all threads, metadata) of one prepare of the corpus."""
    started, cpu_started = time.perf_counter(), time.process_time()
    prepare_dataset([], str(output), **kwargs)
    cpu_s = time.process_time() - cpu_started
    return time.perf_counter() - started, cpu_s, read_metadata(output)


def loader_us_per_batch(dataset: Path, steps: int, repeats: int) -> float:
    """Microseconds per next_step() of one micro-batch [8, 1025] (global batch 8, dp 1)."""
    best = float("inf")
    for _ in range(repeats):
        loader = BatchLoader(dataset, "train", 1024, 8, 8, dp_rank=0, dp_size=1, seed=0)
        loader.next_step()
        started = time.perf_counter()
        for _ in range(steps):
            loader.next_step()
        best = min(best, (time.perf_counter() - started) / steps * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench_data-") as scratch:
        root = Path(scratch)
        byte_runs = [timed_prepare(root / f"byte{i}") for i in range(args.repeats)]
        byte_s, byte_cpu, meta = min(byte_runs, key=lambda run: run[0])
        megabytes = meta["text_bytes"] / 1e6
        corpus = f"{meta['n_docs']} docs, {megabytes:.1f} MB"

        def rate(label: str, seconds: float, cpu_s: float | None = None) -> None:
            cpu = f"{cpu_s:.2f} s" if cpu_s is not None else ""
            rows.append((label, f"{seconds:.3f} s", cpu, f"{megabytes / seconds:.1f} MB/s"))

        rate("prepare byte (whole)", byte_s, byte_cpu)
        bpe_s, bpe_cpu, bpe_meta = timed_prepare(
            root / "bpe", tokenizer="bpe", vocab_size=args.vocab_size
        )
        training_s = bpe_meta["seconds"]["tokenizer_training"]
        rows.append(("BPE training", f"{training_s:.3f} s", "", f"vocab {bpe_meta['vocab_size']}"))
        rate("BPE encoding", bpe_meta["seconds"]["encoding"])
        rate("prepare bpe (whole)", bpe_s, bpe_cpu)
        tokenizer_file = str(root / "bpe" / "tokenizer.json")
        file_s, file_cpu, _ = timed_prepare(root / "bpe_file", tokenizer=tokenizer_file)
        rate("prepare tokenizer.json", file_s, file_cpu)
        ratio = meta["n_tokens"] / bpe_meta["n_tokens"]
        tokens = f"{bpe_meta['n_tokens']} tok"
        rows.append(("BPE compression", tokens, "", f"{ratio:.2f} bytes/tok"))

        for name, dataset in (("byte", root / "byte0"), ("bpe", root / "bpe")):
            micros = loader_us_per_batch(dataset, args.steps, args.repeats)
            rows.append((f"loader {name} [8, 1025]", f"{micros:.0f} us", "", "per batch"))

    print(f"built-in corpus: {corpus}; {os.cpu_count()} CPUs")
    width = max(len(row[0]) for row in rows)
    print(f"{'measure':<{width}}  {'wall':>12}  {'cpu':>8}  {'rate':>16}")
    for label, seconds, cpu, value in rows:
        print(f"{label:<{width}}  {seconds:>12}  {cpu:>8}  {value:>16}")


if __name__ == "__main__":
    main()
