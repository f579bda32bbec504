"""Everything a user sees, recorded so that a change inside the project can be shown to change
none of it: a matrix of short training runs (each step's logged metrics as float.hex, the final
checkpoint's full weights and optimizer state as SHA-256 digests per tensor, its metadata, the
files `export --format hf` writes) and `check` / `plan` over every shipped config (stdout,
stderr and exit status, byte for byte).

    python scripts/same_results.py record OUT.json [--only NAME...] [--jobs N]
    python scripts/same_results.py compare OUT.json [--only NAME...] [--jobs N]
    python scripts/same_results.py --list

compare runs the entries again and prints each difference as `entry | what | before | after`;
it exits 1 on any difference, 0 when everything is equal. Every entry runs in a temporary
working directory of its own (configs copied in, relative paths, one thread a process), so the
checkout's runs/ and data/ are never read and no path of this machine enters a record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
STEPS = 3
# configs/tiny*.yaml made small: 4 micro-batches of 2 a step at dp 1 (gradient accumulation)
SMALL = [
    "model.n_layer=2", "model.max_seq_len=16", "train.seq_len=16", "train.micro_batch_size=2",
    "train.global_batch_size=8", "train.warmup_steps=1", "train.eval_every=0",
    "train.log_every=1",
]  # fmt: skip
GPT2 = [*SMALL, "model.d_model=32", "model.n_head=4"]
SP = ["parallel.sequence_parallel=true"]
OVERLAP = ["parallel.tp_comm_overlap=true"]
BUCKETS = ["optim.bucket_mb=0.01"]  # several buckets: reductions start during backward
PP4 = ["model.n_layer=4"]
# fp8 at tp 2: blockwise needs 128-multiples of every GEMM's shard (tests/fp8/test_fp8_cli.py)
FP8 = [
    *SMALL, "train.precision=fp8", "model.n_layer=1", "model.d_model=256", "model.n_head=2",
    "model.d_ff=512", "model.max_seq_len=128", "train.seq_len=128", "train.global_batch_size=4",
    *SP,
]  # fmt: skip
DEEPSEEK = [*SMALL, "model.n_layer=3", "model.mtp_depth=1"]
TP2, DP2, EP2 = ["parallel.tp=2"], ["parallel.dp=2"], ["parallel.dp=2", "parallel.ep=2"]
ROWWISE, BLOCKWISE = ["train.fp8_recipe=rowwise"], ["train.fp8_recipe=blockwise"]
LLAMA = ["model.arch=llama", "model.n_kv_head=2"]
NO_OVERLAP, DOCUMENTS = ["optim.overlap_grad_reduce=false"], ["data.document_mask=true"]
MISTRAL = ["model.arch=mistral", "model.n_kv_head=2", "model.sliding_window=8"]
# name -> (config, world, overrides): one process runs `train`, more run `launch`
TRAIN: dict[str, tuple[str, int, list[str]]] = {
    "smoke": ("tiny.yaml", 1, [*GPT2, "model.n_layer=1", "train.steps=2"]),
    "gpt2 tp1": ("tiny.yaml", 1, GPT2),
    "tp2 sp": ("tiny.yaml", 2, [*GPT2, *TP2, *SP]),
    "tp2 sp overlap": ("tiny.yaml", 2, [*GPT2, *TP2, *SP, *OVERLAP]),
    "dp2 zero0": ("tiny.yaml", 2, [*GPT2, *DP2, "optim.zero=0", *BUCKETS]),
    "dp2 zero1": ("tiny.yaml", 2, [*GPT2, *DP2, "optim.zero=1", *BUCKETS]),
    "dp2 zero2": ("tiny.yaml", 2, [*GPT2, *DP2, "optim.zero=2", *BUCKETS]),
    "dp2 zero3": ("tiny.yaml", 2, [*GPT2, *DP2, "optim.zero=3", *BUCKETS]),
    "dp2 zero1 no overlap": ("tiny.yaml", 2, [*GPT2, *DP2, "optim.zero=1", *NO_OVERLAP]),
    "pp2 1f1b": ("tiny.yaml", 2, [*GPT2, *PP4, "parallel.pp=2"]),
    "pp2 interleaved": ("tiny.yaml", 2, [*GPT2, *PP4, "parallel.pp=2", "parallel.pp_virtual=2"]),
    "cp2 document mask": ("tiny.yaml", 2, [*GPT2, *LLAMA, "parallel.cp=2", *DOCUMENTS]),
    "fp8 tensorwise tp2 sp": ("tiny.yaml", 2, [*FP8, *TP2]),
    "fp8 tensorwise tp2 sp overlap": ("tiny.yaml", 2, [*FP8, *TP2, *OVERLAP]),
    "fp8 rowwise tp2 sp": ("tiny.yaml", 2, [*FP8, *TP2, *ROWWISE]),
    "fp8 rowwise tp2 sp overlap": ("tiny.yaml", 2, [*FP8, *TP2, *ROWWISE, *OVERLAP]),
    "fp8 blockwise tp2 sp": ("tiny.yaml", 2, [*FP8, *TP2, *BLOCKWISE]),
    "fp8 blockwise tp2 sp overlap": ("tiny.yaml", 2, [*FP8, *TP2, *BLOCKWISE, *OVERLAP]),
    "bf16 tp2": ("tiny.yaml", 2, [*GPT2, *TP2, "train.precision=bf16"]),
    "full recompute tp2": ("tiny.yaml", 2, [*GPT2, *TP2, "train.activation_checkpointing=full"]),
    "selective recompute": ("tiny.yaml", 1, [*GPT2, "train.activation_checkpointing=selective"]),
    "llama": ("tiny.yaml", 1, [*GPT2, *LLAMA]),
    "qwen3 tp2": ("tiny-qwen3.yaml", 2, [*SMALL, *TP2]),
    "mistral sliding window": ("tiny.yaml", 1, [*GPT2, *MISTRAL]),
    "qwen3-moe ep2": ("tiny-qwen3-moe.yaml", 2, [*SMALL, *EP2]),
    "moe": ("tiny-moe.yaml", 1, SMALL),
    "deepseek-v3 mla mtp ep2": ("tiny-deepseek-v3.yaml", 2, [*DEEPSEEK, *EP2]),
}
# One run of each model family whose final checkpoint `export --format hf` writes out.
EXPORTED = {"gpt2 tp1", "llama", "qwen3 tp2", "mistral sliding window", "qwen3-moe ep2", "moe"}
EXPORTED |= {"deepseek-v3 mla mtp ep2"}
# Metrics that measure time or memory, not the computation.
UNSTABLE = {
    "tokens_per_s", "mfu", "hfu", "step_time_s", "phases", "peak_memory_gb", "peak_memory_rank",
    "straggler",
}  # fmt: skip
GPU_PLAN = ["--gpus", "8", "--gpu", "H100"]
CPU_PLAN = ["--device", "cpu", "--gpus", "2", "--gpu-memory", "8", "--calibration", "host.json"]
# A fixed CPU host for `plan --device cpu` (a measured one would change from run to run).
RATES = {
    "matmul_flops": 5.0e10, "gemm_fraction": 0.8, "attention_fraction": 0.4,
    "memory_bytes_s": 5.0e9, "op_overhead_s": 1.0e-5,
}  # fmt: skip
HOST = {
    "cores": 2, "threads": {"1": RATES, "2": RATES}, "shm_latency_s": 1.0e-5,
    "shm_bytes_s": 5.0e9, "gloo_latency_s": 5.0e-5, "gloo_bytes_s": 1.0e9,
}  # fmt: skip


def command_entries() -> dict[str, list[str]]:
    """`check` and `plan` of every shipped config: name -> the command's arguments."""
    entries = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        config = f"configs/{path.name}"
        entries[f"check {path.name}"] = ["check", "--config", config]
        plan = CPU_PLAN if path.name.startswith("tiny") else GPU_PLAN
        entries[f"plan {path.name}"] = ["plan", "--config", config, *plan]
    return entries


def entry_names() -> list[str]:
    return [*TRAIN, *command_entries()]


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`megatronish ARGS` in cwd with one thread a process and this checkout first on the path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-m", "megatronish", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)


def workspace(tmp: Path) -> None:
    """The configs and the fixed CPU host that the entries' commands name by relative path."""
    shutil.copytree(CONFIGS, tmp / "configs")
    (tmp / "host.json").write_text(json.dumps(HOST) + "\n")


def run_command(name: str, tmp: Path) -> dict:
    result = cli(command_entries()[name], tmp)
    return {
        "exit": result.returncode,
        "stdout": result.stdout.replace(str(tmp), "<tmp>"),
        "stderr": result.stderr.replace(str(tmp), "<tmp>"),
    }


def metric_values(run_dir: Path) -> dict:
    """Each training step's logged values, floats as float.hex()."""
    values = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in sorted(record.items()):
            if key in UNSTABLE or key == "step":
                continue
            shown = value.hex() if isinstance(value, float) else value
            values[f"step {record['step']} {key}"] = shown
    return values


def digest(tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    sha = hashlib.sha256(f"{tensor.dtype} {list(tensor.shape)}\n".encode())
    sha.update(raw.numpy().tobytes())
    return sha.hexdigest()


def checkpoint_values(checkpoint_dir: Path) -> dict:
    """The saved step's full tensors (the reader joins the shards) and its metadata."""
    from megatronish.checkpoint.reader import Checkpoint
    from megatronish.data import cache_root

    saved = Checkpoint(checkpoint_dir)
    values = {}
    for name in sorted(saved.specs):
        values[f"weights {name}"] = digest(saved.full(name))
        if saved.has_optimizer_state(name):
            for kind in ("exp_avg", "exp_avg_sq"):
                values[f"optimizer {name}.{kind}"] = digest(saved.full(name, kind))
            values[f"optimizer {name}.step"] = digest(saved.scalar(name))
    saved.verify()  # the files' checksums
    meta = json.loads(saved.meta_path.read_text().replace(str(cache_root()), "<cache>"))
    meta.pop("created_at")
    # A file's bytes (so its crc32c) vary from run to run: safetensors writes the header's
    # metadata in a per-process hash order. Its tensors are compared above.
    for info in meta["files"].values():
        info.pop("crc32c", None)
    for key, value in sorted(meta.items()):
        for part, shown in sorted(value.items()) if key in ("files", "tensors") else [("", value)]:
            values[f"checkpoint metadata {key} {part}".rstrip()] = json.dumps(shown, sort_keys=True)
    values["checkpoint files"] = " ".join(sorted(p.name for p in saved.dir.iterdir()))
    config = (saved.dir / "config.yaml").read_bytes()
    values["checkpoint config.yaml"] = hashlib.sha256(config).hexdigest()
    return values


def export_values(tmp: Path) -> dict:
    result = cli(["export", "--checkpoint", "ckpt", "--format", "hf", "--output", "hf"], tmp)
    values: dict = {"export exit": result.returncode}
    values |= {"export stdout": result.stdout, "export stderr": result.stderr}
    for path in sorted((tmp / "hf").rglob("*")) if (tmp / "hf").is_dir() else []:
        if path.is_file():
            key = f"export {path.relative_to(tmp / 'hf').as_posix()}"
            values[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return values


def run_training(name: str, tmp: Path) -> dict:
    config, world, overrides = TRAIN[name]
    sets = [*overrides, "run.out_dir=run", "checkpoint.dir=ckpt"]
    sets += [f"train.steps={STEPS}"] if not any(s.startswith("train.steps") for s in sets) else []
    args = ["train" if world == 1 else "launch", "--config", f"configs/{config}"]
    for setting in sets:
        args += ["--set", setting]
    result = cli(args, tmp)
    values: dict = {"exit": result.returncode}
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        values["error"] = lines[-1] if lines else ""
        return values
    values.update(metric_values(tmp / "run"))
    values.update(checkpoint_values(tmp / "ckpt"))
    if name in EXPORTED:
        values.update(export_values(tmp))
    return values


def run_entry(name: str) -> dict:
    """One entry's values, run in a temporary working directory of its own."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="same-results-") as directory:
        tmp = Path(directory).resolve()
        workspace(tmp)
        values = run_training(name, tmp) if name in TRAIN else run_command(name, tmp)
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return values


def run_all(names: list[str], jobs: int) -> dict[str, dict]:
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(zip(names, pool.map(run_entry, names)))


def differences(before: dict[str, dict], after: dict[str, dict]) -> list[tuple]:
    """(entry, what, before, after) for every value that is not the same in both."""
    found = []
    for entry in sorted(set(before) | set(after)):
        old, new = before.get(entry, {}), after.get(entry, {})
        for what in sorted(set(old) | set(new)):
            if old.get(what, "<none>") != new.get(what, "<none>"):
                found.append((entry, what, old.get(what, "<none>"), new.get(what, "<none>")))
    return found


def shown_difference(what: str, old, new) -> tuple[str, str, str]:
    """A difference on one line: of two texts, their first line that differs."""
    if not (isinstance(old, str) and isinstance(new, str) and "\n" in old + new):
        return what, json.dumps(old), json.dumps(new)
    old_lines, new_lines = old.splitlines() + ["<end>"], new.splitlines() + ["<end>"]
    line = next(i for i, pair in enumerate(zip(old_lines, new_lines)) if pair[0] != pair[1])
    return f"{what} line {line + 1}", json.dumps(old_lines[line]), json.dumps(new_lines[line])


def selected(only: list[str] | None) -> list[str]:
    names = entry_names()
    unknown = [n for n in only or [] if n not in names]
    if unknown:
        raise SystemExit(f"--only: unknown entries {unknown}; --list shows them")
    return [n for n in names if not only or n in only]


def describe() -> None:
    for name, (config, world, overrides) in TRAIN.items():
        shown = " ".join(overrides) + (" + export hf" if name in EXPORTED else "")
        print(f"{name}: {config} world {world} {shown}")
    for name, args in command_entries().items():
        print(f"{name}: megatronish {' '.join(args)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", nargs="?", choices=["record", "compare"])
    parser.add_argument("file", nargs="?", type=Path)
    parser.add_argument("--only", nargs="+", metavar="NAME")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--list", action="store_true", help="print the entries")
    args = parser.parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the checkpoint reader of this checkout
    if args.list:
        describe()
        return 0
    if args.action is None or args.file is None:
        parser.error("record or compare needs OUT.json")
    names = selected(args.only)
    if args.action == "record":
        args.file.write_text(json.dumps(run_all(names, args.jobs), indent=1) + "\n")
        return 0
    before = json.loads(args.file.read_text())
    before = {name: before[name] for name in names if name in before}
    found = differences(before, run_all(names, args.jobs))
    for entry, what, old, new in found:
        print(" | ".join([entry, *shown_difference(what, old, new)]))
    print(f"{len(found)} difference(s) over {len(names)} entries", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
