"""The compute ops of the model, each with a torch reference and a Triton kernel.

Every op takes ``backend="auto" | "triton" | "torch"``; autograd works on both. ``auto`` picks
Triton for CUDA tensors and torch elsewhere. ``triton`` on CPU tensors runs the kernels under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set, and otherwise raises a clear error.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatronish.config.kernel_dims import triton_attention_dims_ok
from megatronish.errors import UserError
from megatronish.ops import reference
from megatronish.ops.rope import PLAIN, RopeSpec, rope_table

BACKENDS = ("auto", "triton", "torch")


class BackendUnavailable(UserError):
    """The Triton backend was asked for where it cannot run (a user's choice: exit status 2)."""


def check_backend(backend: str, device: torch.device) -> None:
    """Raises BackendUnavailable when `backend` cannot run on device (before any work)."""
    resolve_backend(backend, torch.empty(0, device=device))


def _triton_usable(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The backend an op runs with for tensor x: "torch" or "triton"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if x.is_cuda and _kernels() is not None else "torch"
    if not _triton_usable(x):
        raise BackendUnavailable(
            "kernels.backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 on CPU; "
            "valid here: auto, torch"
        )
    if _kernels() is None:
        raise BackendUnavailable(
            "kernels.backend: 'triton' needs the triton package (pip install triton); "
            "valid here: auto, torch"
        )
    return "triton"


def attention_backend(backend: str, q: torch.Tensor, v: torch.Tensor | None = None) -> str:
    """The backend attention runs with for q [..., d] and v [..., dv] (None: dv = d):
    resolve_backend's, except that "auto" takes torch for head dims (d, dv) the Triton
    attention kernels do not take (config.kernel_dims.triton_attention_dims_ok; the config checks
    refuse them with an explicit "triton")."""
    resolved = resolve_backend(backend, q)
    v_dim = q.shape[-1] if v is None else v.shape[-1]
    if resolved == "triton" and backend == "auto":
        return resolved if triton_attention_dims_ok(q.shape[-1], v_dim) else "torch"
    return resolved


_KERNELS: Any = None


def _kernels() -> Any:
    """The kernels' functions (megatronish_kernels.functions), or None when triton is not
    installed."""
    global _KERNELS
    if _KERNELS is None:
        try:
            from megatronish_kernels import functions
        except ImportError:
            _KERNELS = False
        else:
            _KERNELS = functions
    return _KERNELS or None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    backend: str = "auto",
    offset: float = 0.0,
):
    """RMSNorm of x [..., h] with weight [h], scaled by offset + weight (added in fp32)."""
    if resolve_backend(backend, x) == "triton":
        return _kernels().rms_norm(x, weight, eps, offset)
    return reference.rms_norm(x, weight, eps, offset)


def layer_norm(x, weight, bias, eps: float = 1e-5, backend: str = "auto"):
    """LayerNorm of x [..., h] with weight [h] and bias [h] (or None)."""
    if resolve_backend(backend, x) == "triton":
        return _kernels().layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def attention(
    q,
    k,
    v,
    causal: bool = True,
    backend: str = "auto",
    segments=None,
    window=None,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    row_max: torch.Tensor | None = None,
):
    """Scaled dot-product attention, scale 1/sqrt(d) unless given: q [b, n_head, s, d], k [b,
    n_kv_head, s, d] and v [b, n_kv_head, s, dv] -> [b, n_head, s, dv]. With segments [b, s]
    int (each position's document, non-decreasing along the sequence:
    megatronish.context.documents) a query sees the keys of its own document only; with a
    sliding window W (int), the query at i sees the keys at j with i - j < W only. The Triton
    kernels skip the blocks of keys that lie wholly in other documents or outside the window.
    softcap (logit soft-capping) and sinks [n_head] (a learned logit per head in every
    softmax's denominator): reference.attention; the kernels take them too. row_max (Triton
    only; QK-clip's record): fp32 [b, n_head, s] the forward kernel fills with each query's
    largest score after any soft-cap."""
    options = dict(scale=scale, sinks=sinks, softcap=softcap)
    if attention_backend(backend, q, v) == "triton":
        return _kernels().attention(q, k, v, causal, segments, window, **options, row_max=row_max)
    if row_max is not None:
        raise ValueError("attention: row_max is the Triton kernels' (backend triton)")
    return reference.attention(
        q, k, v, causal, segments, window, scale=scale, sinks=sinks, softcap=softcap
    )


def rope(x, theta: float | RopeSpec = PLAIN, backend: str = "auto", positions=None):
    """Rotary position embedding of x [b, n, s, d], rotate-half pairing, at positions 0..s-1 or
    at the given int64 positions [s] (a context-parallel shard's global positions) or [b, s]
    (each sequence's own: positions within documents). theta: RoPE's base, or a RopeSpec (its
    theta and context scaling: megatronish.ops.rope). Both backends rotate by rope_table's cos
    and sin."""
    spec = theta if isinstance(theta, RopeSpec) else RopeSpec(float(theta))
    if resolve_backend(backend, x) == "triton":
        cos, sin = rope_table(spec, x.shape[-2], x.shape[-1], x.device, positions=positions)
        return _kernels().rope(x, cos, sin)
    return reference.rope(x, spec, positions=positions)


def swiglu(gate, up, backend: str = "auto"):
    """silu(gate) * up."""
    if resolve_backend(backend, gate) == "triton":
        return _kernels().swiglu(gate, up)
    return reference.swiglu(gate, up)


def geglu(gate, up, backend: str = "auto"):
    """gelu(gate) * up, tanh approximation (Gemma's gelu_pytorch_tanh)."""
    if resolve_backend(backend, gate) == "triton":
        return _kernels().geglu(gate, up)
    return reference.geglu(gate, up)


def activate(kind: str, gate, up, limit: float | None = None, backend: str = "auto"):
    """A gated MLP's activation (config.components' mlp): swiglu, geglu, or GPT-OSS's
    clamped_swiglu at `limit` (torch ops on every backend)."""
    if kind == "geglu":
        return geglu(gate, up, backend)
    if kind == "clamped_swiglu":
        return reference.clamped_swiglu(gate, up, limit)
    return swiglu(gate, up, backend)


def bias_gelu(x, bias, backend: str = "auto"):
    """gelu(x + bias), tanh approximation; bias may be None."""
    if resolve_backend(backend, x) == "triton":
        return _kernels().bias_gelu(x, bias)
    return reference.bias_gelu(x, bias)


def grouped_mm(x, w, offsets, backend: str = "auto"):
    """x [A, k] rows sorted by group times each group's w[g] ([G, k, n], any strides) ->
    [A, n]; offsets [G] int: each group's cumulative end row (a group may be empty). One
    Triton grouped GEMM on CUDA (no host synchronisation); a loop over the groups in torch."""
    if resolve_backend(backend, x) == "triton":
        return _kernels().grouped_mm(x, w, offsets)
    return reference.grouped_mm(x, w, offsets)


def cross_entropy(logits, target, tp_group=None, backend: str = "auto"):
    """Per-token loss of logits [..., vocab / tp] (this rank's vocab shard) against global target
    ids [...]; vocab-parallel over tp_group when it has more than one rank; -100 is ignored."""
    if resolve_backend(backend, logits) == "triton":
        from megatronish.ops.vocab_split import GroupVocabSplit

        return _kernels().cross_entropy(logits, target, GroupVocabSplit.of(tp_group))
    from megatronish.layers.cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, target, tp_group=tp_group)
