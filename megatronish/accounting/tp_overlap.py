"""What parallel.tp_comm_overlap leaves exposed of the tensor-parallel collectives it
decomposes (megatronish.layers.overlap), for the step-time model (accounting.step_time).

A decomposed collective (``Collective.under`` names the GEMM it runs under, one of
accounting.layer_time.linear_gemms, of G seconds whole) runs in pieces, each under the GEMM of
one of t sequence chunks, G / t:

- ring hops ("tp_ring", each a 1 / t chunk of the tensor): each of a collective's t - 1 hops
  overlaps one chunk's GEMM, so a hop is exposed by what it takes beyond G / t;
- an all-reduce in t chunks along the sequence: chunk k's all-reduce runs under chunk k + 1's
  GEMM and the last one has nothing left to hide under: (t - 1) max(0, a - G / t) + a exposed
  per collective, a the time of one chunk's all-reduce.

Hidden is the rest of the collectives' time. Collectives left whole stay exposed.
"""

from __future__ import annotations

from megatronish.accounting.collectives import Collective


def split_seconds(op: Collective, seconds: float, gemm_s: float, tp: int) -> tuple[float, float]:
    """(exposed, hidden) seconds of all op.count calls of a decomposed collective, which take
    `seconds` together, each run under a GEMM of gemm_s seconds (whole, before the split into
    tp chunks)."""
    piece, chunk = seconds / op.count, gemm_s / tp
    if op.kind == "tp_ring":
        exposed = op.count * max(0.0, piece - chunk)
    else:  # op.count chunked all-reduces, tp per collective
        exposed = op.count / tp * ((tp - 1) * max(0.0, piece - chunk) + piece)
    return exposed, seconds - exposed
