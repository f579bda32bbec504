"""Model FLOPs, the device peak that MFU divides by, and the metrics.jsonl writer."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from megatronish.config import Config, Derived

# Dense bf16 peak per GPU (no sparsity), TFLOP/s, matched against torch.cuda.get_device_name.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "V100": 125.0,
}


def moe_mlp_params(cfg: Config, derived: Derived, active: bool = False) -> int:
    """Parameters of one MoE MLP: the router, every expert (active: the top_k a token goes
    through) and the shared expert."""
    moe, h, f = cfg.model.moe, cfg.model.d_model, derived.moe_d_ff
    experts = moe.top_k if active else moe.num_experts
    return moe.num_experts * h + (experts + int(moe.shared_expert)) * 3 * h * f


def matmul_params(cfg: Config, derived: Derived) -> int:
    """Parameters that take part in a matmul per token: every block's linear weights (of an
    MoE MLP, the router and the top_k experts a token goes through) and the output layer (the
    embedding lookup and norms are not matmuls)."""
    m, h = cfg.model, cfg.model.d_model
    qkv = h * (m.n_head + 2 * derived.n_kv_head) * derived.head_dim
    proj = m.n_head * derived.head_dim * h
    mlp = (3 if m.arch == "llama" else 2) * h * derived.d_ff
    moe = len(derived.moe_layers)
    active = moe * moe_mlp_params(cfg, derived, active=True) if moe else 0
    return m.n_layer * (qkv + proj) + (m.n_layer - moe) * mlp + active + h * derived.vocab_size


def model_flops_per_step(cfg: Config, derived: Derived) -> float:
    """Training FLOPs of one optimizer step (Narayanan et al. 2021, written for any MLP):
    3 x forward, forward per token = 2 x matmul parameters + 4 l s h for attention scores and
    values; x 4/3 with full recompute. With d_ff = 4h this is 72 B s l h^2 (1 + s/6h + V/12lh)."""
    t, m = cfg.train, cfg.model
    attn = 4 * m.n_layer * t.seq_len * m.n_head * derived.head_dim
    forward = 2 * matmul_params(cfg, derived) + attn
    passes = 4 if t.activation_checkpointing == "full" else 3
    return float(passes * forward * derived.tokens_per_step)


def peak_flops(device: torch.device) -> tuple[float, str]:
    """FLOP/s that MFU divides by for one device, with where the figure comes from: the dense
    bf16 peak of a known GPU, else a measured fp32 matmul rate (CPU, or an unknown GPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name} dense bf16 peak"
    return _measured(device, torch.get_num_threads()), f"measured fp32 matmul on {device.type}"


@functools.cache
def _measured(device: torch.device, threads: int) -> float:
    """measured_matmul_flops once per process, device and thread count."""
    return measured_matmul_flops(device)


def measured_matmul_flops(device: torch.device, size: int | None = None, trials: int = 10) -> float:
    """The best of `trials` timings of a size x size fp32 matmul, after two warm-up calls (the
    best, because a core taken by something else only ever makes a trial slower). Default size:
    512 on a CPU (its rate there is 1024's, measured in a tenth of the time: every rank of
    every run measures), 1024 on a GPU."""
    if size is None:
        size = 512 if device.type == "cpu" else 1024
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


class MetricsWriter:
    """Appends one JSON object a line to <out_dir>/metrics.jsonl (rank 0 only), and with
    tensorboard its scalars to <out_dir>/tb."""

    def __init__(self, out_dir: Path, enabled: bool, append: bool = False, tensorboard=False):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file = self._tensorboard = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w")
            if tensorboard:
                from megatronish.observe.tensorboard import TensorBoardWriter

                self._tensorboard = TensorBoardWriter(out_dir)

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def parameter_count(cfg: Config, derived: Derived, active: bool = False) -> int:
    """Parameters of the full model (all tp and ep ranks together), at the real (unpadded)
    vocab; active: those one token goes through (of each MoE MLP the router, its top_k experts
    and the shared expert)."""
    m, h = cfg.model, cfg.model.d_model
    bias = m.arch == "gpt2"
    norm = 2 * h if bias else h
    qkv_out = (m.n_head + 2 * derived.n_kv_head) * derived.head_dim
    attn = h * qkv_out + m.n_head * derived.head_dim * h + (qkv_out + h if bias else 0)
    mlp = (3 if m.arch == "llama" else 2) * h * derived.d_ff + (derived.d_ff + h if bias else 0)
    per_layer = attn + mlp + 2 * norm
    embed = derived.vocab_size * h + (m.max_seq_len * h if m.arch == "gpt2" else 0)
    head = 0 if derived.tie_embeddings else derived.vocab_size * h
    moe = len(derived.moe_layers)
    experts = moe * (moe_mlp_params(cfg, derived, active) - mlp) if moe else 0
    return m.n_layer * per_layer + experts + embed + norm + head
