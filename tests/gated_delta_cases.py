"""Inputs of the gated delta rule for the op and kernel tests (megatronish.ops.gated_delta's
layout), the loss whose gradients they compare, and the comparison against a float64
reference under tolerances.GATED_DELTA_REL."""

from __future__ import annotations

import torch

from tests.tolerances import GATED_DELTA_REL

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def inputs(b=1, k_heads=1, heads=2, seq=100, dk=16, dv=32, seed=0) -> list[torch.Tensor]:
    """Float64 leaves: q, k [b, k_heads, seq, dk], v [b, heads, seq, dv], g (log-decays in
    (-0.5, 0)) and beta (in (0, 1)) [b, heads, seq], an initial state [b, heads, dk, dv]."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -0.5 * torch.rand(b, heads, seq, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, heads, seq, generator=gen, dtype=torch.float64)
    state = 0.5 * randn(b, heads, dk, dv)
    return [randn(b, k_heads, seq, dk), randn(b, k_heads, seq, dk), randn(b, heads, seq, dv),
            g, beta, state]  # fmt: skip


def upstream(out: torch.Tensor, state: torch.Tensor, seed=1) -> tuple[torch.Tensor, ...]:
    """Random float64 gradients of the output and of the final state."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (out, state))


def outputs_and_grads(fn, leaves, dtype=torch.float64) -> list[torch.Tensor]:
    """fn(*leaves as dtype) = (o, final state), then the gradients of <o, do> + <state, ds> with
    respect to every leaf, all as float64."""
    xs = [x.detach().to(dtype).requires_grad_(True) for x in leaves]
    out, state = fn(*xs)
    do, ds = upstream(out, state)
    loss = (out.double() * do).sum() + (state.double() * ds).sum()
    return [t.detach().double() for t in (out, state, *torch.autograd.grad(loss, xs))]


def assert_close(ours, reference, bound=GATED_DELTA_REL) -> dict[str, float]:
    """Every tensor of ours within bound times the largest magnitude of its reference; returns
    the relative errors by name (o, state, then the gradients of NAMES)."""
    names = ("o", "state", *(f"d{n}" for n in NAMES))
    errors = {}
    for name, a, r in zip(names, ours, reference, strict=True):
        errors[name] = ((a - r).abs().max() / r.abs().max()).item()
    assert all(e <= bound for e in errors.values()), errors
    return errors
