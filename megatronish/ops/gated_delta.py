"""The gated delta rule (Gated DeltaNet's linear attention, as in Qwen3.5's linear layers).

Per head, a state S [d_k, d_v] runs along the sequence; at token t, with log-decay g_t <= 0
and learning rate beta_t:

    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T (scale q_t)

Layout (as attention's): q, k [b, h_k, s, d_k], v [b, h, s, d_v], g and beta [b, h, s], the
state [b, h, d_k, d_v]; h a multiple of h_k (each query-key head serves h / h_k consecutive
value heads). scale is 1/sqrt(d_k) unless given; with l2norm_qk, q and k are L2-normalized
(eps 1e-6 under the root) first, in fp32.

Three evaluations: `recurrent` (token by token, in the inputs' dtype: the float64 reference of
the tests), `chunked` (the WY / UT form over chunks of CHUNK tokens, in fp32, or fp64 for fp64
inputs; torch autograd through it) and the Triton kernels (megatronish_kernels.gated_delta).
Within a chunk with cumulative log-decays G_i (G = cumsum g) and D_ij = exp(G_i - G_j) (i >= j):

    A = strict_lower(diag(beta) K K^T * D),  T = (I + A)^-1
    W = T diag(beta e^G) K,  U = T diag(beta) V,  V' = U - W S
    O = scale (diag(e^G) Q S + lower(Q K^T * D) V')
    S <- e^G_last S + (diag(e^(G_last - G)) K)^T V'

Chunks chain exactly: running the rule on a sequence's first part and then, from its final
state, on the rest is running it on the whole (the context-parallel split's contract).
"""

from __future__ import annotations

import torch

from megatronish.config.kernel_dims import TRITON_GATED_DELTA_DIMS
from megatronish.ops import _kernels, resolve_backend

CHUNK = 64
L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dtype)
    return (y * torch.rsqrt((y * y).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def prepare(q, k, v, l2norm_qk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k with a head per value head (repeated h / h_k times), L2-normalized if asked."""
    heads, k_heads = v.shape[1], k.shape[1]
    if heads % k_heads or q.shape[1] != k_heads:
        raise ValueError(f"value heads {heads} must be a multiple of query-key heads {k_heads}")
    if heads != k_heads:
        q = q.repeat_interleave(heads // k_heads, dim=1)
        k = k.repeat_interleave(heads // k_heads, dim=1)
    if l2norm_qk:
        q, k = _l2norm(q), _l2norm(k)
    return q, k


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _zero_state(q, v, dtype) -> torch.Tensor:
    b, h, _, d_k = q.shape
    return torch.zeros(b, h, d_k, v.shape[-1], dtype=dtype, device=q.device)


def recurrent(q, k, v, g, beta, scale: float, initial_state=None):
    """(o, final state) token by token, in the inputs' dtype (q, k already per value head):
    the definition, for references and tests."""
    state = _zero_state(q, v, v.dtype) if initial_state is None else initial_state.to(v.dtype)
    outputs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, state)) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t] * scale, state))
    return torch.stack(outputs, dim=2), state


def _pad_chunks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x padded with zeros along dim to a multiple of CHUNK: padded tokens (k = 0, beta = 0,
    g = 0) leave the state as it is."""
    pad = -x.shape[dim] % CHUNK
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _chunk_terms(q, k, v, g, beta, scale: float):
    """Each chunk's G (cumulative log-decays), W, U, the intra-chunk scores P = scale lower(Q
    K^T * D), scale e^G Q and e^(G_last - G) K, chunks along dim 2: [b, h, n, CHUNK, ...]."""
    b, h, s, _ = q.shape
    q, k, v = (x.reshape(b, h, s // CHUNK, CHUNK, -1) for x in (q, k, v))
    g, beta = (x.reshape(b, h, s // CHUNK, CHUNK) for x in (g, beta))
    cum = g.cumsum(-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    # (I + A) X = B, A strictly lower: solve_triangular reads A's diagonal as ones.
    w = torch.linalg.solve_triangular(a, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)  # fmt: skip
    u = torch.linalg.solve_triangular(a, v * beta[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay * scale
    q_decayed = q * (cum.exp()[..., None] * scale)
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    return cum[..., -1].exp(), w, u, scores, q_decayed, k_decayed


def chunked(q, k, v, g, beta, scale: float, initial_state=None):
    """(o, final state) by the WY / UT chunked form in fp32 (fp64 for fp64 inputs), q and k
    already per value head; o in v's dtype, the state in fp32 (fp64)."""
    dtype, out_dtype, seq = _compute_dtype(v), v.dtype, q.shape[2]
    q, k, v = (_pad_chunks(x.to(dtype), 2) for x in (q, k, v))
    g, beta = (_pad_chunks(x.to(dtype), 2) for x in (g, beta))
    chunk_decay, w, u, scores, q_decayed, k_decayed = _chunk_terms(q, k, v, g, beta, scale)
    state = _zero_state(q, v, dtype) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for n in range(w.shape[2]):
        v_new = u[:, :, n] - w[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + scores[:, :, n] @ v_new)
        update = k_decayed[:, :, n].transpose(-1, -2) @ v_new
        state = state * chunk_decay[:, :, n, None, None] + update
    out = torch.cat(outputs, dim=2)[:, :, :seq]
    return out.to(out_dtype), state


def gated_delta_backend(backend: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """resolve_backend's, except that "auto" takes torch for head dims the Triton kernels do
    not take (TRITON_GATED_DELTA_DIMS); an explicit "triton" there raises ValueError."""
    resolved = resolve_backend(backend, q)
    if resolved == "triton" and not {q.shape[-1], v.shape[-1]} <= set(TRITON_GATED_DELTA_DIMS):
        if backend == "auto":
            return "torch"
        raise ValueError(f"the Triton gated delta rule takes head dims {TRITON_GATED_DELTA_DIMS}")
    return resolved


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    l2norm_qk: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (layout in the module's docstring): (o [b, h, s, d_v] in v's
    dtype, the final state [b, h, d_k, d_v] in fp32 when output_final_state, else None).
    Autograd reaches every input, the initial state included. torch runs the chunked form;
    triton the kernels (chunked alike, fp32 accumulation, bf16 or fp32 inputs)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = prepare(q, k, v, l2norm_qk)
    if gated_delta_backend(backend, q, v) == "triton":
        out, state = _kernels().gated_delta_rule(q, k, v, g, beta, scale, initial_state)
    else:
        out, state = chunked(q, k, v, g, beta, scale, initial_state)
    return out, (state if output_final_state else None)
