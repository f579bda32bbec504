"""Every bound the suite compares numbers to, named, with where it comes from. The unit
roundoffs: fp32 u = 2^-24 (6.0e-8), bf16 2^-8, fp64 2^-53 (1.1e-16). A sum of K terms added in
another order moves by at most 2 K u times the sum of the terms' magnitudes (each order is
within K u of the exact sum): `reordered_sum_bound`, the one derivation of it. A name's value
is the bound with the margin said beside it; a tolerance of 0 means the same operations in the
same order (bit for bit).

Bounds a module of tests/layers/, tests/fp8/, tests/data_parallel/ or tests/optim/ derives
beside its checks are still written there."""

from __future__ import annotations

U_FP32 = 2.0**-24
U_BF16 = 2.0**-8
U_FP64 = 2.0**-53


def reordered_sum_bound(terms: int, u: float = U_FP32) -> float:
    """How far two evaluations of a sum of `terms` terms, added in different orders, can
    differ, relative to the sum of the terms' magnitudes: each is within terms * u of the exact
    sum, so they are within 2 * terms * u of each other."""
    return 2 * terms * u


# The same operations in the same order: bit for bit.
EXACT = 0.0

# fp64 against fp64 in another order (a definition written out, a loop against a batched op):
# sums of up to ~1e3 terms of magnitude ~1, 2 K u_64 = 2.2e-13; 1e-12 leaves a factor of 4.
FP64_REORDER = 1e-12

# A few fp32 operations on the same values in another order or through another path (shared
# memory against gloo, an fp32 routing weight against its fp64 reference): each rounding
# 6.0e-8 relative; 1e-6 allows about 16 of them.
FP32_FEW_OPS_REL = 1e-6
# Its absolute companion for values that are sums of such quantities near zero (gradients of a
# tiny model, ~1e-2): 1e-6 relative of them, with a factor of 10 margin.
FP32_GRAD_ABS = 1e-7
# A value near zero whose relative error means nothing (a gate weight of ~1e-3 through the
# fp32 softmax): 1e-6 of it.
FP32_TINY_ABS = 1e-9

# One fp32 layer or kernel against its reference in another order (the GEMMs and reductions of
# a tiny model: K <= 64 terms): reordered_sum_bound(64) = 7.6e-6 relative; 1e-5, on values of
# magnitude ~1 so the same number serves as the absolute bound.
FP32_REORDER = 1e-5
# The attention outputs of one fp32 process against several (cp ranks' ring, a cache's
# incremental decode): softmax-weighted sums of <= 16 values of magnitude ~1, K u = 1e-6 each
# before the merge of two partial softmaxes: 1e-6 absolute at cp, twice the ring's K for the
# decode cache's growing sums (2e-5 covers the logits, 10 times the values' magnitude).
FP32_RING_ABS = 1e-6
FP32_DECODE_ABS = 2e-5
# The cross entropy's gradient softmax(z) - onehot over a vocabulary of V <= 67: each entry
# below 1 with an fp32 exp and a division, off by a few u of the entry; 5e-6 and 1e-6 (the
# smaller vocabulary) on top of FP32_REORDER relative.
CE_GRAD_ABS = 5e-6
CE_GRAD_SMALL_ABS = 1e-6
# A fused fp32 kernel (Triton) against the op it replaces: sums of K <= 128 terms in the
# kernel's tile order, reordered_sum_bound(128) = 1.5e-5 relative on values of magnitude ~1:
# 1e-4 relative and 1e-5 absolute, the same pair as PARITY_REL, PARITY_ABS below.
KERNEL_REL = 1e-4
KERNEL_ABS = 1e-5
# rope's kernel against fp64: the angle p * theta, computed in fp32, is off by about u p theta,
# 7.6e-6 radians at positions p ~ 128; on rotated values of magnitude up to ~2: 2e-5.
KERNEL_ROPE_ABS = 2e-5

# Another implementation of the same model (transformers, the pipeline's stages in other
# processes, experts dispatched over ranks): every GEMM and reduction of a 4-layer model in
# its own order, sums of up to K = 1024 terms, reordered_sum_bound(1024) = 1.2e-4 worst case
# and ~K^0.5 u in practice: 1e-4 relative; 1e-5 absolute for the values near zero.
PARITY_REL = 1e-4
PARITY_ABS = 1e-5
# Two training curves (loss per step) of the same run through different processes: PARITY_REL.
CURVE_REL = PARITY_REL
# The parity harness's curves (tests/parity.py: 10 steps of a 4-layer d_model 32 model) at
# another layout against one process: its GEMMs' sums of K <= 128 terms in another order,
# reordered_sum_bound(128) = 1.5e-5 worst case per sum, averaged over every token in the loss:
# 1e-5 relative.
LAYOUT_CURVE_REL = 1e-5
# How far OVERLAP may move a curve: the decomposition adds the same fp32 partial sums in another
# order (megatronish.layers.overlap), each sum off by about one rounding, 2^-24 relative; the
# loss and the gradient norm are means over every token and parameter of such sums, and 20
# steps of AdamW carry the difference on at that size: 1e-6 leaves a factor of ten.
OVERLAP_REL = 1e-6
# How far tp, cp or OVERLAP may move an fp8 run's first step (loss, gradient norm) from one
# process's: they add a GEMM's fp32 partial sums in another order, which moves a value by up to
# K u relative (K terms, reordered_sum_bound) before the next GEMM casts it. A value that close
# to a rounding boundary of its fp8 format is cast a whole step (2^-3 of its binade in e4m3)
# away instead: up to 2 K u / 2^-3 = 16 K u of the casts, 4.9e-4 at K = 512 (the longest sum of
# tests/commands/test_bench.py's fp8 runs, blockwise's d_ff). Were all of them to move the loss
# or the norm the same way by their whole step, it would move by 16 K u 2^-3 = 6.1e-5 relative.
# (Measured: 1.6e-5, blockwise at tp 2; a tensorwise scale taken from one rank's shard or tokens
# moves the first step's gradient norm by 2.0e-4 at tp 2 and 6.4e-4 at cp 2.)
FP8_REORDER_REL = 1e-4

# bf16 GEMMs (u = 2^-8 = 3.9e-3) against fp32 or fp64: a sum of K terms rounded once to bf16
# at the output, and its inputs each rounded once: ~3 u = 1.2e-2 relative; 2e-2 leaves margin.
BF16_GEMM = 2e-2
# The bf16 ring attention's outputs, log-sum-exps and gradients against fp64: a few bf16
# roundings of values ~1 (one per merge of two partial softmaxes, two ranks): ~8 u = 3.1e-2.
BF16_RING_ABS = 3e-2
# The chunked gated delta rule (fp32) against its float64 recurrence: each output is a chain of
# at most 4 GEMMs (W or U, V' = U - W S, then O or the next state; the backward's dR, dT, dA and
# dK likewise), each a sum of at most 64 + d <= 192 terms (a chunk's tokens, or the head dim 128
# and the chunk): 4 reordered_sum_bound(192) = 9.2e-5, relative to the largest magnitude of the
# compared tensor (the terms are of its size with l2-normalized q and k and beta, e^g <= 1):
# 1e-4.
GATED_DELTA_REL = 1e-4
