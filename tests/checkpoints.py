"""The checkpoint harness, shared by the checkpoint, Hugging Face, generation and fault tests:
tiny configs (`tiny_cfg`, vocab VOCAB), a model trained a couple of steps on random tokens
(`trained`) and its tp = 1 checkpoint (`save_single`), random `tokens`, a small prepared
dataset of standard-library sources (`prepare_small_dataset`; the `small_dataset` fixture of
tests/conftest.py is one, prepared once per session), and a worker giving checkpoints' logits
at tp > 1 (`logits_at_tp`)."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import torch

from megatronish.checkpoint.save import TokenizerInfo, save_checkpoint
from megatronish.config import Config, load_config
from megatronish.data_parallel import data_parallel_for
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from megatronish.objectives.registry import sequence_losses

VOCAB = 257  # the byte tokenizer's
BYTES = TokenizerInfo("byte", 256)


def tiny_cfg(arch: str = "gpt2", *extra: str, tp: int = 1, dp: int | None = None) -> Config:
    """2 layers, d_model 64, 4 heads (llama: 2 kv heads), vocab 257, max_seq_len 64."""
    overrides = [
        f"model.arch={arch}",
        "model.n_layer=2",
        "model.n_head=4",
        "model.d_model=64",
        "model.max_seq_len=64",
        f"model.vocab_size={VOCAB}",
        "train.seq_len=32",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        f"parallel.tp={tp}",
    ]
    if arch == "llama":
        overrides += ["model.n_kv_head=2", "model.d_ff=96"]
    if dp is not None:
        overrides.append(f"parallel.dp={dp}")
    return load_config(None, overrides + list(extra))


def trained(cfg: Config, ps: ParallelState, steps: int = 2, lr: float = 1e-2):
    """(model in eval mode, optimizer, derived) after `steps` AdamW steps on random tokens (two
    sequences per dp rank), so no weight is at its init and the AdamW state is not zero. The
    optimizer is data parallelism without buckets: under ZeRO each parameter's state is whole
    on one rank."""
    from megatronish.config import derive

    derived = derive(cfg, ps.world_size, vocab_size=VOCAB)
    model = GPT(cfg, derived, ps)
    optimizer = data_parallel_for(model, cfg, ps, buckets=False)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (2 * ps.dp, 17), generator=gen)[2 * ps.dp_rank :][:2]
        optimizer.start_of_step(1)
        sequence_losses(model, batch[:, :-1], batch[:, 1:]).total.backward()
        optimizer.after_backward()
        optimizer.step(lr)
        optimizer.after_step()
    return model.eval(), optimizer, derived


def save_single(
    directory: Path, cfg: Config, step: int = 2, tokenizer: TokenizerInfo = BYTES
) -> tuple[Path, GPT]:
    """A tp = 1 checkpoint of a trained tiny model, saved in this process."""
    ps = ParallelState.single()
    model, optimizer, derived = trained(cfg, ps)
    path = save_checkpoint(
        directory,
        step,
        cfg=cfg,
        derived=derived,
        ps=ps,
        model=model,
        optimizer=optimizer,
        tokenizer=tokenizer,
    )
    return path, model


def prepare_small_dataset(directory: Path, **kwargs) -> Path:
    """A dataset (byte-level unless kwargs say otherwise) of ~400 KB of the standard library's
    json and email sources."""
    from megatronish.data import prepare_dataset

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(f"{stdlib}/json/*.py")) + sorted(glob.glob(f"{stdlib}/email/*.py"))
    return prepare_dataset(files, str(directory), val_fraction=0.2, **kwargs)


def tokens(batch: int = 2, length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_at_tp(rank: int, world: int, checkpoints: list[str], batch: torch.Tensor) -> list:
    """A run_on_ranks worker: each checkpoint's model loaded at tp = world (one tp group) and its
    full logits of `batch`, over the checkpoint's real vocab."""
    from megatronish.checkpoint.reader import Checkpoint
    from megatronish.inference.model import build_model
    from megatronish.layers import mappings

    ps, out = ParallelState.from_world(world, 1), []
    for path in checkpoints:
        ckpt = Checkpoint(path)
        model = build_model(ckpt, ps)
        with torch.no_grad():
            logits = mappings.gather_from_tensor_parallel_region(model(batch), ps.tp_group)
        out.append(logits[..., : ckpt.vocab_size])
    return out
