"""Every kernel compiled for a GPU target, on any machine: no GPU is needed.

Holds the launches of one model shape (built by the launchers' own `*_launch` functions on meta
tensors, so the check compiles exactly what a GPU run launches: tiles, warps, stages and the
specialization of every argument), their compilation with Triton for sm_80 or sm_90, and each
cubin's registers, spills (its stack frame) and shared memory (`cuobjdump
--dump-resource-usage` plus Triton's dynamic shared memory) against the architecture's limits,
with the occupancy those allow (read and estimated in gpu_resources.py).
scripts/kernel_report.py runs it over the shipped configs, tests/kernels/test_kernel_compile.py
at one configuration per kernel, and scripts/gpu_check.py puts it next to what the driver
reports.

Shapes (one tensor-parallel rank's): b batch, s sequence, h d_model, n and kv heads, d head
dim, f MLP width, v vocab shard, E local experts, A = b s top_k expert rows.

TRITON_INTERPRET must be unset (or 0) when this package is imported: the interpreter compiles
nothing.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import torch

from ._utils import Launch, persistent_programs
from .attention import forward_launch
from .attention_bwd import backward_launches
from .compile_fp8 import fp8_launches
from .cross_entropy import ce_backward_launch, ce_forward_launch
from .elementwise import bias_gelu_launch, swiglu_launch
from .gpu_resources import Arch, cubin_resources, occupancy_warps
from .grouped_gemm import grouped_dw_launch, grouped_mm_launch
from .norms import norm_backward_launch, norm_forward_launch
from .rope import rope_launch

ARCHS = {
    "sm_80": Arch("sm_80", 80, 163 * 1024, 164 * 1024),  # A100
    "sm_89": Arch("sm_89", 89, 99 * 1024, 100 * 1024, max_warps=48),  # L4, L40S (fp8 from here)
    "sm_90": Arch("sm_90", 90, 227 * 1024, 228 * 1024),  # H100, H200
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class ModelShapes:
    """What one tensor-parallel rank of a model hands the kernels: its shard's sizes."""

    name: str  # e.g. "gpt2-124m tp2"
    family: str  # gpt2 (LayerNorm, bias-GELU) or llama (RMSNorm, RoPE, SwiGLU)
    batch: int
    seq_len: int
    d_model: int
    head_dim: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab: int
    norm_rows: int  # rows the norms see: b s, over tp with sequence parallelism
    experts: int = 0  # local experts of an MoE layer (0: dense MLPs only)
    top_k: int = 0
    expert_d_ff: int = 0  # one expert's MLP width on this rank
    v_head_dim: int = 0  # the value head dim where it differs from head_dim (0: head_dim)
    rope_dim: int = 0  # the dims RoPE rotates where not all of head_dim (0: head_dim)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def attention_pass(
    m: ModelShapes,
    dtype: torch.dtype,
    arch: int,
    seq_len: int,
    causal: bool,
    ring: bool,
    documents: bool,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: bool = False,
) -> list[Launch]:
    """Forward and backward of attention at sequence (or ring block) length seq_len; a ring
    block's forward writes fp32 (attention_block_forward); documents: under document masks
    (data.document_mask: segments and the per-block ranges); window: (W, offset) under a
    sliding window of W over queries offset positions after the keys, or None; softcap: the
    logits' soft-cap, or None; sinks: with a sink logit per head (compile_scores)."""
    v_dim = m.v_head_dim or m.head_dim
    q = _meta(m.batch, m.n_head, seq_len, m.head_dim, dtype=dtype)
    k = _meta(m.batch, m.n_kv_head, seq_len, m.head_dim, dtype=dtype)
    v = _meta(m.batch, m.n_kv_head, seq_len, v_dim, dtype=dtype)
    do = _meta(m.batch, m.n_head, seq_len, v_dim, dtype=dtype)
    lse = _meta(m.batch, m.n_head, seq_len, dtype=torch.float32)
    out = torch.empty_like(do, dtype=torch.float32 if ring else dtype)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    segments = None
    if documents:
        segments = (_meta(m.batch, seq_len, dtype=torch.int32),) * 2
    sliding = window or (None, 0)
    head_sinks = _meta(m.n_head, dtype=torch.float32) if sinks else None
    args = (q, k, v, do, lse, do, lse, grads, causal, arch, segments, *sliding)
    backward = backward_launches(*args, softcap=softcap)
    forward_args = (q, k, v, out, lse, causal, arch, segments, *sliding)
    return [forward_launch(*forward_args, softcap=softcap, sinks=head_sinks), *backward]


def _norms(m: ModelShapes, dtype: torch.dtype) -> list[Launch]:
    is_rms = m.family == "llama"
    x = _meta(m.norm_rows, m.d_model, dtype=dtype)
    weight = _meta(m.d_model, dtype=dtype)
    bias = None if is_rms else torch.empty_like(weight)
    stats = _meta(m.norm_rows, dtype=torch.float32)
    parts = _meta(persistent_programs(m.norm_rows), m.d_model, dtype=torch.float32)
    return [
        norm_forward_launch(x, weight, bias, x, stats, stats, 1e-5, is_rms),
        norm_backward_launch(
            x, weight, x, x, stats, stats, parts, None if is_rms else parts, is_rms
        ),
    ]


def _mlp(m: ModelShapes, dtype: torch.dtype) -> list[Launch]:
    """RoPE and SwiGLU (llama), or bias-GELU (gpt2; under bf16 autocast the bias stays an fp32
    parameter while x comes out of a bf16 matmul)."""
    hidden = _meta(m.batch, m.seq_len, m.d_ff, dtype=dtype)
    if m.family != "llama":
        bias = _meta(m.d_ff, dtype=torch.float32)
        return [
            bias_gelu_launch(hidden, bias, hidden),
            bias_gelu_launch(hidden, bias, hidden, hidden),
        ]
    rope_dim = m.rope_dim or m.head_dim
    x = _meta(m.batch, m.n_head, m.seq_len, rope_dim, dtype=dtype)
    table = _meta(m.seq_len, rope_dim // 2, dtype=torch.float32)
    return [
        rope_launch(x, x, table, table, False),
        rope_launch(x, x, table, table, True),
        swiglu_launch(hidden, hidden, hidden),
        swiglu_launch(hidden, hidden, hidden, (hidden, hidden)),
    ]


def _cross_entropy(m: ModelShapes, dtype: torch.dtype) -> list[Launch]:
    rows = m.batch * m.seq_len
    logits = _meta(rows, m.vocab, dtype=dtype)
    target = _meta(rows, dtype=torch.int64)
    stats = _meta(rows, dtype=torch.float32)
    # shard_start 0 (rank 0): another rank's start is a multiple of v, specialized alike.
    return [
        ce_forward_launch(logits, target, stats, stats, 0),
        ce_backward_launch(logits, target, stats, stats, logits, 0),
    ]


def _experts(m: ModelShapes, dtype: torch.dtype) -> list[Launch]:
    """The grouped GEMMs of GroupedExperts: forward through the transposed [E, f, h] and
    [E, h, f] weights, dx through the weights themselves, dw into contiguous gradients."""
    rows = m.batch * m.seq_len * m.top_k
    offsets = _meta(m.experts, dtype=torch.int64)
    launches = []
    for k, n in ((m.d_model, m.expert_d_ff), (m.expert_d_ff, m.d_model)):
        x, y = _meta(rows, k, dtype=dtype), _meta(rows, n, dtype=dtype)
        weight = _meta(m.experts, n, k, dtype=dtype)  # as stored: [E, out, in]
        launches += [
            grouped_mm_launch(x, weight.transpose(1, 2), y, offsets),
            grouped_mm_launch(y, weight, x, offsets),
            grouped_dw_launch(x, y, _meta(m.experts, k, n, dtype=dtype), offsets),
        ]
    return launches


def _attention_launches(
    m: ModelShapes, dtype: torch.dtype, arch: int, documents: bool, sliding: bool = False
) -> list[tuple[Launch, str]]:
    """Causal attention and the blocks of a cp = 2 ring (2c causal and c unmasked, c = s / 4),
    each with where it comes from ("" or "ring", with " documents" under document masks).
    sliding: under a sliding window of c / 2 instead (tagged " window"): causal attention, and
    the ring's c-blocks, causal and one chunk (c positions) after its keys."""
    tag = (" window" if sliding else "") + (" documents" if documents else "")
    block = m.seq_len // 4
    window = max(1, block // 2)
    whole_window = (window, 0) if sliding else None
    whole = attention_pass(m, dtype, arch, m.seq_len, True, False, documents, whole_window)
    launches = [(launch, tag.strip()) for launch in whole]
    ring_blocks = [(2 * block, True, None), (block, False, None)]
    if sliding:
        ring_blocks = [(block, True, (window, 0)), (block, False, (window, block))]
    if block >= 16:
        for length, causal, ring_window in ring_blocks:
            ring = attention_pass(m, dtype, arch, length, causal, True, documents, ring_window)
            launches += [(launch, "ring" + tag) for launch in ring]
    return launches


def model_launches(m: ModelShapes, dtype: str, arch: Arch) -> list[tuple[Launch, str]]:
    """Every launch one training step of model m makes in dtype ("bf16" or "fp32") on arch,
    each with where it comes from: attention and the ring blocks (_attention_launches), norms,
    RoPE, the MLP's elementwise op, cross entropy and the expert GEMMs; then attention and the
    ring blocks again under document masks (data.document_mask), and under a sliding window
    (model.sliding_window, for llama) without and with document masks; last, on sm_89 and
    newer, the fp8 casts and GEMMs of the fp8 linear layers (compile_fp8, tagged "fp8")."""
    torch_dtype, cap = DTYPES[dtype], arch.capability
    others = _norms(m, torch_dtype) + _mlp(m, torch_dtype) + _cross_entropy(m, torch_dtype)
    if m.experts:
        others += _experts(m, torch_dtype)
    launches = [
        *_attention_launches(m, torch_dtype, cap, documents=False),
        *[(launch, "") for launch in others],
        *_attention_launches(m, torch_dtype, cap, documents=True),
    ]
    if m.family == "llama":
        for documents in (False, True):
            launches += _attention_launches(m, torch_dtype, cap, documents, sliding=True)
    return launches + [(launch, "fp8") for launch in fp8_launches(m, torch_dtype, cap)]


# Compilation


def specialization(launch: Launch) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of a launch for triton.compiler.ASTSource, as Triton's
    launcher specializes its arguments: a tensor is a pointer of its dtype, 16-byte aligned
    (torch's CUDA allocations are); an int is i32 (i64 past 2^31), 16-divisible when it is,
    and the constant 1 when it is 1; a float is fp32; None is the constant None. The launch
    gives every constexpr."""
    names = launch.kernel.arg_names
    runtime = [name for name in names if name not in launch.constexprs]
    if len(runtime) != len(launch.args):
        raise ValueError(f"{launch.name}: {len(launch.args)} arguments for {runtime}")
    signature = {name: "constexpr" for name in names}
    constexprs, attrs = dict(launch.constexprs), {}
    aligned = [["tt.divisibility", 16]]
    for name, value in zip(runtime, launch.args, strict=True):
        index = (names.index(name),)
        if value is None:  # an absent pointer (attention without document masks)
            constexprs[name] = None
        elif isinstance(value, torch.Tensor):
            signature[name] = f"*{TYPE_NAMES[value.dtype]}"
            attrs[index] = aligned
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int) and value == 1:
            constexprs[name] = 1
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[index] = aligned
        else:
            signature[name] = "fp32"
    return signature, constexprs, attrs


def compile_launch(launch: Launch, arch: Arch) -> Any:
    """The launch compiled by Triton for arch (its CompiledKernel: asm["cubin"], metadata)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature, constexprs, attrs = specialization(launch)
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    return compile(source, target=GPUTarget("cuda", arch.capability, 32), options=options)


@dataclass
class Compiled:
    """One compiled kernel configuration on one arch: the row of the report."""

    kernel: str
    config: str
    arch: str
    dtype: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    shared_limit_bytes: int
    num_warps: int
    num_stages: int
    occupancy_warps: int
    cubin_bytes: int
    models: tuple[str, ...] = ()


def describe(launch: Launch) -> str:
    """The launch configuration in a few words: the constexprs, the arguments specialized to
    1, warps and stages (e.g. "CAUSAL HEAD_DIM=128 BLOCK_M=128 BLOCK_N=64 w8 s2")."""
    words = []
    _, constexprs, _ = specialization(launch)
    for name, value in constexprs.items():
        if name == "PREC" or value is None:  # None: an absent pointer
            continue
        if isinstance(value, bool):
            words += [name] if value else []
        else:
            words.append(f"{name}={value}")
    return " ".join([*words, f"w{launch.num_warps}", f"s{launch.num_stages}"])


def launch_dtype(launch: Launch) -> str:
    """The dtype of the launch's first tensor (the data it computes on)."""
    first = next(a for a in launch.args if isinstance(a, torch.Tensor))
    return TYPE_NAMES[first.dtype]


def measure(kernel: Any, launch: Launch, arch: Arch) -> Compiled:
    """The row of a launch compiled for arch (compile_launch's kernel): its cubin's registers
    and spills (stack frame and local memory, per thread), and its shared memory per block
    (the cubin's static shared memory plus the dynamic shared memory Triton launches it with)."""
    usage = cubin_resources(kernel.asm["cubin"])
    shared = usage.get("SHARED", 0) + kernel.metadata.shared
    return Compiled(
        kernel=launch.name,
        config=describe(launch),
        arch=arch.name,
        dtype=launch_dtype(launch),
        registers=usage["REG"],
        spill_bytes=usage.get("STACK", 0) + usage.get("LOCAL", 0),
        shared_bytes=shared,
        shared_limit_bytes=arch.shared_limit,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        occupancy_warps=occupancy_warps(usage["REG"], shared, launch.num_warps, arch),
        cubin_bytes=len(kernel.asm["cubin"]),
    )


def compile_and_measure(launch: Launch, arch: Arch) -> Compiled:
    """The launch compiled for arch, and its row."""
    return measure(compile_launch(launch, arch), launch, arch)


def problems(row: Compiled, spills_allowed: bool = False) -> list[str]:
    """What keeps a compiled kernel from fitting its GPU, one clear sentence each: shared
    memory over the arch's limit per block (the launch would fail with OutOfResources), and
    register spills (unless spills_allowed: fp32 runs exact-fp32 dots without tensor cores)."""
    where = f"{row.kernel} [{row.config}] on {row.arch} ({row.dtype})"
    found = []
    if row.shared_bytes > row.shared_limit_bytes:
        found.append(
            f"{where}: needs {row.shared_bytes} bytes of shared memory per block, over the "
            f"{row.arch} limit of {row.shared_limit_bytes}: use smaller tiles or fewer stages"
        )
    if row.spill_bytes and not spills_allowed:
        found.append(
            f"{where}: spills {row.spill_bytes} bytes of registers to local memory "
            f"({row.registers} registers): use smaller tiles or more warps"
        )
    return found


def compile_support() -> str | None:
    """Why Triton cannot compile for an NVIDIA target on this machine, or None when it can."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return "Triton has no NVIDIA backend on this platform"
    from triton import knobs

    for tool in ("ptxas", "cuobjdump"):
        try:
            path = getattr(knobs.nvidia, tool).path
        except Exception as exc:  # a knob that finds no binary raises
            return f"Triton ships no {tool} here ({exc})"
        if not path or shutil.which(path) is None:
            return f"Triton's {tool} is missing"
        try:
            subprocess.run([path, "--version"], capture_output=True, check=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"Triton's {tool} does not run on this platform ({exc})"
    return None
