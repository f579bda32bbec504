"""Checkpoint save and load speed for GPT-2 124M on CPU at tp = 1, one process, and what
checking the files' checksums costs.

    python scripts/bench_checkpoint.py [--repeats 2] [--load-repeats 5] [--dir DIR]

The model (configs/gpt2-124m.yaml, fp32) and its AdamW state (filled by one optimizer step on
a tiny batch) are saved with the trainer's save path (safetensors shards, fsync, rename,
`latest`), then restored into a fresh model and optimizer; load_model (which also builds the
model) is timed apart. Prints a table of seconds, size on disk and MB/s (best of --repeats)
and, last, one JSON object. The load reads files the save just wrote, so it reads them from
the page cache: it measures deserialization and copying, not the disk.

Blocked time: how long training waits for a save, synchronous (the whole save) and with
checkpoint.async (the copy of the state at the save, plus its completion at a later step once
the writer is done: checksum gather, metadata.json, rename, `latest`); the writer's time runs
beside training and is not counted, the bench waits for it between the two. The first async
save also allocates the copy's buffers (later saves reuse them): both are printed.

Checksums: the restore and load_model are timed twice, on the checkpoint as saved (every file
checked against its CRC-32C, as a resume and every loader do) and on a copy whose metadata.json
records no checksums (hard links to the same files), which loads unchecked; the difference is
what checking costs a load. The restore includes reading the restored AdamW state once (see
restore()), so that both read every byte. What it costs a save is the CRC-32C of the bytes
written, timed on the checkpoint's bytes in memory. Candidate checksums are timed on the same
bytes; the last line (JSON) has the figures and the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch
from crc32c import crc32c

from megatronish import load_model
from megatronish.checkpoint.async_save import AsyncSaver
from megatronish.checkpoint.load import restore_model, restore_optimizer, restore_rng
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import TokenizerInfo, save_checkpoint
from megatronish.config import Config, derive, load_config
from megatronish.data_parallel import data_parallel_for
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.objectives.registry import sequence_losses

REPO = Path(__file__).resolve().parent.parent
CPU_OVERRIDES = ["parallel.tp=1", "optim.zero=0", "train.precision=fp32", "kernels.backend=torch"]
GPT2_124M = [
    "model.arch=gpt2",
    "model.n_layer=12",
    "model.n_head=12",
    "model.d_model=768",
    "model.vocab_size=50257",
    "model.max_seq_len=1024",
]


def gpt2_124m() -> Config:
    path = REPO / "configs" / "gpt2-124m.yaml"
    if path.is_file():
        return load_config(path, CPU_OVERRIDES)
    return load_config(None, GPT2_124M + CPU_OVERRIDES)


def build(cfg: Config, with_state: bool):
    ps = ParallelState.single()
    derived = derive(cfg, 1)
    model = GPT(cfg, derived, ps)
    optimizer = data_parallel_for(model, cfg, ps, buckets=False)
    if with_state:
        batch = torch.randint(0, derived.vocab_size, (1, 17))
        sequence_losses(model, batch[:, :-1], batch[:, 1:]).total.backward()
        optimizer.step(cfg.train.lr)
        optimizer.after_step()
    return model, optimizer, derived


def disk_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir() if p.is_file())


def unchecked_copy(step_dir: Path, where: Path) -> Path:
    """The checkpoint under `where` with the same files (hard links) and a metadata.json that
    records no checksums, as a checkpoint saved before they were recorded."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    for path in step_dir.iterdir():
        if path.name != "metadata.json":
            os.link(path, where / path.name)
    meta = json.loads((step_dir / "metadata.json").read_text())
    for info in meta["files"].values():
        info.pop("crc32c", None)
    (where / "metadata.json").write_text(json.dumps(meta))
    return where


def restore(step_dir: Path, cfg: Config) -> float:
    """Seconds to restore model, optimizer and RNGs into a fresh model, checking the files as a
    resume does (Checkpoint.verify), and to read every byte of the restored AdamW state once:
    without ZeRO the state is the file's memory map, read only where the first step reads it,
    so without this an unchecked restore would leave two thirds of its reading to that step."""
    fresh, fresh_optimizer, _ = build(cfg, with_state=False)
    started = time.perf_counter()
    ckpt = Checkpoint(step_dir)
    ckpt.check_in_background()
    restore_model(ckpt, fresh)
    restore_optimizer(ckpt, fresh_optimizer, fresh)
    restore_rng(ckpt, fresh, fresh.ps)
    ckpt.verify()
    for state in fresh_optimizer.states_to_save().values():
        state["exp_avg"].sum(), state["exp_avg_sq"].sum()
    return time.perf_counter() - started


def timed_load_model(step_dir: Path) -> float:
    started = time.perf_counter()
    load_model(step_dir)
    return time.perf_counter() - started


CANDIDATES = {
    "crc32c": lambda data: crc32c(data),
    "zlib.crc32": lambda data: zlib.crc32(data),
    "zlib.adler32": lambda data: zlib.adler32(data),
    "blake2b": lambda data: hashlib.blake2b(data).digest(),
    "sha256": lambda data: hashlib.sha256(data).digest(),
}


def checksum_seconds(step_dir: Path, repeats: int) -> dict[str, float]:
    """Best seconds of each candidate over the checkpoint's shard files, their bytes in memory."""
    blobs = [p.read_bytes() for p in sorted(step_dir.glob("*.safetensors"))]
    best = {}
    for name, function in CANDIDATES.items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for blob in blobs:
                function(blob)
            times.append(time.perf_counter() - started)
        best[name] = min(times)
    return best


def async_blocked(root: Path, steps: range, cfg: Config, derived, model, optimizer) -> dict:
    """Seconds training is blocked by each checkpoint.async save of `steps` (copy, then
    completion once the writer is done) and the writer's seconds in between."""
    saver = AsyncSaver()
    copy_s, complete_s, write_s = [], [], []
    try:
        for step in steps:
            started = time.perf_counter()
            saver.begin(
                root,
                step,
                cfg=cfg,
                derived=derived,
                ps=model.ps,
                model=model,
                optimizer=optimizer,
                tokenizer=TokenizerInfo("file", 50256),
                keep=1,
            )
            copy_s.append(time.perf_counter() - started)
            saver.pending.done.wait()  # training would run meanwhile
            write_s.append(time.perf_counter() - started - copy_s[-1])
            started = time.perf_counter()
            saver.complete()
            complete_s.append(time.perf_counter() - started)
    finally:
        saver.close()
    return {"copy_s": copy_s, "complete_s": complete_s, "write_s": write_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="Saves (and loads after each).")
    parser.add_argument(
        "--load-repeats",
        type=int,
        default=5,
        help="Checked and unchecked loads after the last save, alternating (best of each).",
    )
    parser.add_argument("--dir", default=None, help="Where to write (default: a temp dir).")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = gpt2_124m()
    model, optimizer, derived = build(cfg, with_state=True)
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    save_s, restore_s, load_model_s, unchecked_restore_s, unchecked_load_s = [], [], [], [], []
    try:
        for repeat in range(args.repeats):
            started = time.perf_counter()
            step_dir = save_checkpoint(
                root,
                repeat + 1,
                cfg=cfg,
                derived=derived,
                ps=model.ps,
                model=model,
                optimizer=optimizer,
                tokenizer=TokenizerInfo("file", 50256),
                keep=1,
            )
            save_s.append(time.perf_counter() - started)
            unchecked = unchecked_copy(step_dir, root / "unchecked")
            restore_s.append(restore(step_dir, cfg))
            unchecked_restore_s.append(restore(unchecked, cfg))
            load_model_s.append(timed_load_model(step_dir))
            unchecked_load_s.append(timed_load_model(unchecked))
        for _ in range(args.load_repeats):  # alternating, so that noise hits both alike
            restore_s.append(restore(step_dir, cfg))
            unchecked_restore_s.append(restore(unchecked, cfg))
            load_model_s.append(timed_load_model(step_dir))
            unchecked_load_s.append(timed_load_model(unchecked))
        size = disk_bytes(step_dir)
        model_bytes = (step_dir / "model_tp00.safetensors").stat().st_size
        checksums = checksum_seconds(step_dir, args.repeats)
        background = async_blocked(  # after the sync checkpoint's use: these prune it
            root, range(args.repeats + 1, 2 * args.repeats + 2), cfg, derived, model, optimizer
        )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mb = size / 1e6
    rows = [
        ("save (model + AdamW + rng, fsync)", min(save_s), mb),
        ("restore into model + optimizer", min(restore_s), mb),
        ("  the same, unchecked", min(unchecked_restore_s), mb),
        ("load_model (builds the model too)", min(load_model_s), mb),
        ("  the same, unchecked", min(unchecked_load_s), mb),
    ]
    rows += [(f"checksum {name} of the files", sec, mb) for name, sec in checksums.items()]
    print(f"GPT-2 124M: {params:,} parameters, fp32, tp 1, CPU, {torch.get_num_threads()} threads")
    print(f"{'operation':38s} {'seconds':>8s} {'MB':>9s} {'MB/s':>8s}")
    for name, seconds, megabytes in rows:
        print(f"{name:38s} {seconds:8.3f} {megabytes:9.1f} {megabytes / seconds:8.0f}")
    blocked = [c + f for c, f in zip(background["copy_s"], background["complete_s"])]
    best = blocked.index(min(blocked))
    print(
        f"training blocked by a save: sync {min(save_s):.3f} s; async {blocked[best]:.3f} s "
        f"(copy {background['copy_s'][best]:.3f} + completion "
        f"{background['complete_s'][best]:.3f}), {100 * blocked[best] / min(save_s):.1f}% of "
        f"sync; each async save (the first allocates the copy): "
        f"{', '.join(f'{b:.3f}' for b in blocked)} s; the writer took "
        f"{min(background['write_s']):.3f} s beside training"
    )
    check_save = checksums["crc32c"] / min(save_s)
    check_restore = (min(restore_s) - min(unchecked_restore_s)) / min(unchecked_restore_s)
    check_load = (min(load_model_s) - min(unchecked_load_s)) / min(unchecked_load_s)
    print(
        f"checking costs a save {100 * check_save:.1f}% (crc32c of the bytes written), a "
        f"restore {100 * check_restore:+.1f}%, load_model {100 * check_load:+.1f}% (checked vs "
        "unchecked)"
    )
    summary = {
        "parameters": params,
        "checkpoint_mb": round(mb, 1),
        "model_mb": round(model_bytes / 1e6, 1),
        "save_s": round(min(save_s), 3),
        "save_mb_s": round(mb / min(save_s), 1),
        "blocked_sync_s": round(min(save_s), 3),
        "blocked_async_s": round(blocked[best], 3),
        "blocked_async_each_s": [round(b, 3) for b in blocked],
        "async_write_s": round(min(background["write_s"]), 3),
        "restore_s": round(min(restore_s), 3),
        "restore_unchecked_s": round(min(unchecked_restore_s), 3),
        "restore_mb_s": round(mb / min(restore_s), 1),
        "load_model_s": round(min(load_model_s), 3),
        "load_model_unchecked_s": round(min(unchecked_load_s), 3),
        "checksum_s": {name: round(sec, 3) for name, sec in checksums.items()},
        "check_cost_save": round(check_save, 4),
        "check_cost_restore": round(check_restore, 4),
        "check_cost_load_model": round(check_load, 4),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
