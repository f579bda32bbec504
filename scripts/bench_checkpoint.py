"""Checkpoint save and load speed for GPT-2 124M on CPU at tp = 1, one process.

    python scripts/bench_checkpoint.py [--repeats 2] [--dir DIR]

The model (configs/gpt2-124m.yaml, fp32) and its AdamW state (filled by one optimizer step on
a tiny batch) are saved with the trainer's save path (safetensors shards, fsync, rename,
`latest`), then restored into a fresh model and optimizer; load_model (which also builds the
model) is timed apart. Prints a table of seconds, size on disk and MB/s (best of --repeats)
and, last, one JSON object. The load reads files the save just wrote, so it reads them from
the page cache: it measures deserialization and copying, not the disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from megatronish import load_model
from megatronish.checkpoint.load import restore_model, restore_optimizer, restore_rng
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import TokenizerInfo, save_checkpoint
from megatronish.config import Config, derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.optim.optimizer import Optimizer

REPO = Path(__file__).resolve().parent.parent
CPU_OVERRIDES = ["parallel.tp=1", "optim.zero=0", "train.precision=fp32", "kernels.backend=torch"]
GPT2_124M = ["model.arch=gpt2", "model.n_layer=12", "model.n_head=12", "model.d_model=768",
             "model.vocab_size=50257", "model.max_seq_len=1024"]  # fmt: skip


def gpt2_124m() -> Config:
    path = REPO / "configs" / "gpt2-124m.yaml"
    if path.is_file():
        return load_config(path, CPU_OVERRIDES)
    return load_config(None, GPT2_124M + CPU_OVERRIDES)


def build(cfg: Config, with_state: bool):
    ps = ParallelState.single()
    derived = derive(cfg, 1)
    model = GPT(cfg, derived, ps)
    optimizer = Optimizer(model, cfg, ps)
    if with_state:
        batch = torch.randint(0, derived.vocab_size, (1, 17))
        model.loss(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step(cfg.train.lr)
        optimizer.zero_grad()
    return model, optimizer, derived


def disk_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="Where to write (default: a temp dir).")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = gpt2_124m()
    model, optimizer, derived = build(cfg, with_state=True)
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    save_s, restore_s, load_model_s = [], [], []
    try:
        for repeat in range(args.repeats):
            started = time.perf_counter()
            step_dir = save_checkpoint(
                root, repeat + 1, cfg=cfg, derived=derived, ps=model.ps, model=model,
                optimizer=optimizer, tokenizer=TokenizerInfo("file", 50256), keep=1,
            )  # fmt: skip
            save_s.append(time.perf_counter() - started)
            fresh, fresh_optimizer, _ = build(cfg, with_state=False)
            started = time.perf_counter()
            ckpt = Checkpoint(step_dir)
            restore_model(ckpt, fresh)
            restore_optimizer(ckpt, fresh_optimizer, fresh)
            restore_rng(ckpt, fresh, fresh.ps)
            restore_s.append(time.perf_counter() - started)
            del fresh, fresh_optimizer, ckpt
            started = time.perf_counter()
            loaded = load_model(step_dir)
            load_model_s.append(time.perf_counter() - started)
            del loaded
        size = disk_bytes(step_dir)
        model_bytes = (step_dir / "model_tp00.safetensors").stat().st_size
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mb = size / 1e6
    rows = [
        ("save (model + AdamW + rng, fsync)", min(save_s), mb),
        ("restore into model + optimizer", min(restore_s), mb),
        ("load_model (builds the model too)", min(load_model_s), model_bytes / 1e6),
    ]
    print(f"GPT-2 124M: {params:,} parameters, fp32, tp 1, CPU, {torch.get_num_threads()} threads")
    print(f"{'operation':38s} {'seconds':>8s} {'MB':>9s} {'MB/s':>8s}")
    for name, seconds, megabytes in rows:
        print(f"{name:38s} {seconds:8.2f} {megabytes:9.1f} {megabytes / seconds:8.0f}")
    summary = {
        "parameters": params,
        "checkpoint_mb": round(mb, 1),
        "model_mb": round(model_bytes / 1e6, 1),
        "save_s": round(min(save_s), 3),
        "save_mb_s": round(mb / min(save_s), 1),
        "restore_s": round(min(restore_s), 3),
        "restore_mb_s": round(mb / min(restore_s), 1),
        "load_model_s": round(min(load_model_s), 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
