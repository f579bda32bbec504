"""Attention over sequences packed with short documents (data.document_mask) against full causal
attention of the same length: the work the Triton kernels skip, and on CUDA the time it saves.

    python scripts/bench_packed_attention.py [--seq-len 2048] [--doc-len 128] [--iters 20]

A sequence of seq_len tokens holds seq_len / doc_len documents of doc_len tokens, at
bench_kernels.py's attention shape (b4, 32 query and 8 key/value heads, head dim 128, bf16).

Everywhere it prints what the kernels skip: for each kernel (forward, dK/dV, dQ) the block
pairs (query block x key block) it walks with the tiles an sm_80 and an sm_90 GPU launch, next
to those of causal attention, and the attention FLOPs of forward and backward together (each
block pair weighted by the matrix products its kernel does there: 2, 4 and 3); then the
query-key pairs the mask keeps, the least any kernel could compute. With CUDA it also times
our kernel forward and forward+backward (median of CUDA-event timings after warm-up), packed and
causal, prints both and the ratio, and the largest error of the packed output against the
float64 masked attention, next to torch SDPA's (bf16, with the mask).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from megatronish_kernels.attention_tiles import gpu_attention_blocks, segment_bounds
from megatronish_kernels.functions import attention

from megatronish.ops import reference

BATCH, N_HEAD, N_KV, HEAD_DIM = 4, 32, 8, 128
ARCHS = {"sm_80": 80, "sm_90": 90}
GEMMS = {"forward": 2, "dK/dV": 4, "dQ": 3}  # matrix products per block pair


def packed_segments(batch: int, seq_len: int, doc_len: int, device="cpu") -> torch.Tensor:
    """int32 [batch, seq_len]: each position's document, documents of doc_len tokens."""
    positions = torch.arange(seq_len, device=device, dtype=torch.int32)
    return (positions // doc_len).expand(batch, seq_len).contiguous()


def _blocks(length: torch.Tensor, block: int) -> int:
    return int(((length.clamp(min=0) + block - 1) // block).sum())


def query_walk(segments: torch.Tensor | None, seq_len: int, block_m: int, block_n: int) -> int:
    """Key blocks of block_n the forward (or dQ) kernel walks over one causal sequence, summed
    over its query blocks of block_m; segments [1, s] under document masks (the kernel's own
    ranges: attention_tiles.segment_bounds)."""
    starts = torch.arange(0, seq_len, block_m)
    lo, hi = torch.zeros_like(starts), (starts + block_m).clamp(max=seq_len)
    if segments is not None:
        bounds = segment_bounds(segments, segments, block_m)[0].long()
        lo, hi = bounds[:, 0] // block_n * block_n, torch.minimum(hi, bounds[:, 1])
    return _blocks(hi - lo, block_n)


def key_walk(segments: torch.Tensor | None, seq_len: int, block_m: int, block_n: int) -> int:
    """Query blocks of block_m the dK/dV kernel walks over one causal sequence, summed over its
    key blocks of block_n (from the diagonal on)."""
    lo = torch.arange(0, seq_len, block_n)
    hi = torch.full_like(lo, seq_len)
    if segments is not None:
        bounds = segment_bounds(segments, segments, block_n)[0].long()
        lo = torch.maximum(lo, bounds[:, 0] // block_m * block_m)
        hi = torch.minimum(hi, (bounds[:, 1] + block_m - 1) // block_m * block_m)
    return _blocks(hi - lo, block_m)


def walked(seq_len: int, doc_len: int, arch: int) -> dict[str, dict]:
    """Per kernel: its tile, and the block pairs it walks packed and causal, with the bf16
    tiles of GPU arch `arch`."""
    blocks = gpu_attention_blocks(seq_len, HEAD_DIM, torch.bfloat16, arch)
    segments = packed_segments(1, seq_len, doc_len)
    out = {}
    for name, tile, walk in (
        ("forward", blocks.fwd, query_walk),
        ("dK/dV", blocks.dkdv, key_walk),
        ("dQ", blocks.dq, query_walk),
    ):
        counts = [walk(seg, seq_len, tile.block_m, tile.block_n) for seg in (segments, None)]
        out[name] = {"tile": (tile.block_m, tile.block_n), "packed": counts[0], "causal": counts[1]}
    return out


def flops_walked(kernels: dict[str, dict]) -> float:
    """The fraction of causal attention's forward + backward FLOPs the kernels compute packed
    (block pairs weighted by their area and the kernel's matrix products)."""
    work = {
        key: sum(GEMMS[name] * k[key] * k["tile"][0] * k["tile"][1] for name, k in kernels.items())
        for key in ("packed", "causal")
    }
    return work["packed"] / work["causal"]


def exact_pairs(seq_len: int, doc_len: int) -> float:
    """The query-key pairs a document mask keeps, as a fraction of causal attention's."""
    docs, rest = divmod(seq_len, doc_len)
    kept = docs * doc_len * (doc_len + 1) // 2 + rest * (rest + 1) // 2
    return kept / (seq_len * (seq_len + 1) // 2)


def print_walked(seq_len: int, doc_len: int) -> None:
    print(f"documents of {doc_len} tokens in a {seq_len}-token sequence, bf16 d{HEAD_DIM} tiles:")
    print(f"{'arch':6} {'kernel':8} {'tile':>8} {'causal':>8} {'packed':>8} {'skipped':>8}")
    for arch_name, arch in ARCHS.items():
        kernels = walked(seq_len, doc_len, arch)
        for name, k in kernels.items():
            tile, skipped = "x".join(map(str, k["tile"])), 1 - k["packed"] / k["causal"]
            print(
                f"{arch_name:6} {name:8} {tile:>8} {k['causal']:8d} {k['packed']:8d} "
                f"{100 * skipped:7.1f}%"
            )
        skipped = 1 - flops_walked(kernels)
        print(f"{arch_name}: forward + backward FLOPs skipped {100 * skipped:.1f}%")
    print(f"the mask keeps {100 * exact_pairs(seq_len, doc_len):.1f}% of causal's query-key pairs")


def compare(seq_len: int, doc_len: int, measure: Callable, device: str = "cuda") -> dict:
    """Times (ms) of our kernel forward and forward+backward, causal and packed, at the bench
    shape in bf16, and the largest error of the packed output (ours, and torch SDPA with the
    mask) against float64 masked attention."""
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(BATCH, n, seq_len, HEAD_DIM, generator=gen, device=device)
        .to(torch.bfloat16)
        .requires_grad_(True)
        for n in (N_HEAD, N_KV, N_KV)
    )
    segments = packed_segments(BATCH, seq_len, doc_len, device)
    upstream = torch.randn(BATCH, N_HEAD, seq_len, HEAD_DIM, device=device).to(torch.bfloat16)
    times = {}
    for name, segs in (("causal", None), ("packed", segments)):

        def forward(segs=segs):
            with torch.no_grad():
                attention(q, k, v, True, segs)

        def forward_backward(segs=segs):
            torch.autograd.grad(attention(q, k, v, True, segs), (q, k, v), upstream)

        times[name] = {"fwd_ms": measure(forward), "fwd_bwd_ms": measure(forward_backward)}
    with torch.no_grad():
        exact = reference.attention(q.double(), k.double(), v.double(), True, segments)
        errors = {
            "ours": (attention(q, k, v, True, segments).double() - exact).abs().max().item(),
            "torch": (reference.attention(q, k, v, True, segments).double() - exact)
            .abs()
            .max()
            .item(),
        }
    return {"times": times, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--doc-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20, help="timed runs (median reported)")
    args = parser.parse_args(argv)
    if not 0 < args.doc_len <= args.seq_len:
        print("bench_packed_attention: --doc-len must be in 1..--seq-len", file=sys.stderr)
        return 2
    print_walked(args.seq_len, args.doc_len)
    if not torch.cuda.is_available():
        print("\nno CUDA GPU: no timings (the figures above are the kernels' own block ranges)")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_kernels

    result = compare(args.seq_len, args.doc_len, bench_kernels.timer("cuda", 5, args.iters))
    causal, packed = result["times"]["causal"], result["times"]["packed"]
    print(f"\n{torch.cuda.get_device_name()}, b{BATCH} h{N_HEAD}/kv{N_KV} d{HEAD_DIM} bf16:")
    for key, what in (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
        print(
            f"{what:17} causal {causal[key]:8.3f} ms  packed {packed[key]:8.3f} ms  "
            f"packed / causal {packed[key] / causal[key]:.3f}"
        )
    errors = result["errors"]
    print(
        f"packed output max error vs fp64: ours {errors['ours']:.2e}, torch {errors['torch']:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
