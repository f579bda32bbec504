"""Every bound the suite compares numbers to, named, with where it comes from. The unit
roundoffs: fp32 u = 2^-24 (6.0e-8), bf16 2^-8, fp64 2^-53 (1.1e-16). A sum of K terms added in
another order moves by at most 2 K u times the sum of the terms' magnitudes (each order is
within K u of the exact sum): `reordered_sum_bound`, the one derivation of it. A name's value
is the bound with the margin said beside it; a tolerance of 0 means the same operations in the
same order (bit for bit). Bounds that are not roundings (a printed number's last digit, a
cost model's accuracy, time on a shared host) are named here too, with what they come from.
tests/project/test_tolerances.py keeps literal atol=, rtol=, abs= and rel= numbers out of the
other test modules."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

U_FP32 = 2.0**-24
U_BF16 = 2.0**-8
U_FP64 = 2.0**-53
# fp8: e4m3 keeps 3 mantissa bits, e5m2 2; rounding to nearest moves a normal value by at most
# these, relative (a subnormal by half its fixed step instead).
U_E4M3 = 2.0**-4
U_E5M2 = 2.0**-3


def reordered_sum_bound(terms: int, u: float = U_FP32) -> float:
    """How far two evaluations of a sum of `terms` terms, added in different orders, can
    differ, relative to the sum of the terms' magnitudes: each is within terms * u of the exact
    sum, so they are within 2 * terms * u of each other."""
    return 2 * terms * u


# The same operations in the same order: bit for bit.
EXACT = 0.0

# fp64 against fp64 in another order (a definition written out, a loop against a batched op, a
# cost formula evaluated twice in Python floats): sums of up to ~1e3 terms of magnitude ~1,
# 2 K u_64 = 2.2e-13; 1e-12 leaves a factor of 4.
FP64_REORDER = 1e-12

# A Python float stored as fp32 (a tensorboard scalar): one rounding to nearest.
FP32_STORED_REL = U_FP32

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
# One fp32 model against the same model computed another way (split over tp or pp ranks, on
# other BLAS kernels, written out in plain torch): FP32_REORDER relative on its logits and loss.
# Logits of magnitude ~1 as absolute bound: the same number.
FP32_LOGITS_ABS = FP32_REORDER

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
# GPT-OSS's experts exported in bf16 (each weight rounded once, within U_BF16 of itself) against
# the fp32 ones: each of a block's two expert GEMMs moves by U_BF16 of its sum of magnitudes, and
# the residual stream carries each block's move on to the logits: 2 U_BF16 per block, 6 U_BF16 =
# 2.3e-2 for the 3 blocks of tests/hf/test_hf_gpt_oss.py (a bound; the sums' signs cancel most).
BF16_EXPERTS_REL = 2 * 3 * U_BF16
# Two training curves (loss per step) of the same run through different processes: PARITY_REL.
CURVE_REL = PARITY_REL
# Our logits against transformers' (magnitude ~1): PARITY_REL of them, as an absolute bound.
PARITY_LOGITS_ABS = PARITY_REL
# The fp64 sum of n = 30 x 256 such logits (a subprocess prints it): each within PARITY_ABS,
# the errors of either sign, so sqrt(n) PARITY_ABS = 8.8e-4.
PARITY_LOGIT_SUM_ABS = 1e-3
# The parity harness's curves (tests/parity.py: 10 steps of a 4-layer d_model 32 model) at
# another layout against one process: its GEMMs' sums of K <= 128 terms in another order,
# reordered_sum_bound(128) = 1.5e-5 worst case per sum, averaged over every token in the loss:
# 1e-5 relative.
LAYOUT_CURVE_REL = 1e-5
# A DPO reward (beta times a response's log-ratio) and their margin m, where the DPO loss (about
# log 2, as -log sigmoid(m)) is held to a relative bound r: the loss moves by sigmoid(-m) dm,
# about dm / 2, so a margin (and a reward, of which it is the difference) within r log 2 / 0.5
# < 2 r matches the loss's bound.
DPO_REWARD_ABS = 2 * PARITY_REL
DPO_LAYOUT_REWARD_ABS = 2 * LAYOUT_CURVE_REL
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

# The ZeRO levels' curves against ZeRO-0's (tests/data_parallel). The levels compute the same
# gradients and sum them in the same rank order, but clipping's gradient norm is summed in fp32
# per piece of a bucket's block under ZeRO-1 to 3 and per parameter under ZeRO-0, so it differs
# in its last bits (1e-8 to 2e-7 relative); every step clips (grad_clip 1), so the fp32 weights
# the optimizer writes differ by an ulp here and there: FP32_FEW_OPS_REL. In bf16 one step
# between bf16 values is 2^16 fp32 ulps, so now and then (about one weight in 2^16 per ulp
# moved) a weight rounds to the other bf16 neighbour; from then on the two runs are two bf16
# roundings of one computation, whose tokens' losses differ by about U_BF16 relative,
# independently in sign. The mean over the global batch's 8 x 16 tokens (tests/parity.SMALL)
# moves by U_BF16 / sqrt(128) = 3.5e-4 relative; so does the gradient, a mean over the same
# tokens, and its norm by no more (| |a| - |b| | <= |a - b|). The first step, from the same
# weights, holds ZERO_CURVE_REL in bf16 too: it is the same computation, its norm summed apart.
ZERO_CURVE_REL = FP32_FEW_OPS_REL
ZERO_BF16_CURVE_REL = U_BF16 / math.sqrt(8 * 16)
# A gradient reduced in bf16: U_BF16 once for each rank's gradient divided by dp (cast to bf16)
# and once for their sum: within 2 U_BF16 (+ U_BF16^2) of the mean of the ranks' magnitudes
# (relative to the reduced value itself it is unbounded where they cancel).
BF16_REDUCE_REL = 2 * U_BF16 * (1 + U_BF16)
# The losses after such steps move from the fp32 run's by at most 2 U_BF16 of how far the loss
# has moved: AdamW's update is a ratio of moments of a gradient rounded to 2 U_BF16.
BF16_UPDATE_REL = 2 * U_BF16


def fp8_product_magnitude(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A bound on |A_fp8| |B_fp8|^T (fp64) for a [M, K], b [N, K] cast to fp8 by any recipe
    here: a cast value is within U_E5M2 (covering U_E4M3) of its magnitude or 2^-9 / scale
    (subnormals) of it, and 1 / scale <= 2 amax / 448, so 2^-9 / scale < 2^-16 amax."""
    a, b = a.detach().double(), b.detach().double()
    slack_a, slack_b = a.abs().max() * 2.0**-16, b.abs().max() * 2.0**-16
    grow = 1 + U_E5M2
    return (grow * a.abs() + slack_a) @ (grow * b.abs() + slack_b).t()


# Bounds that are not roundings.
# A number printed to two decimals (0.01 MiB, a bubble fraction): half its last digit, plus the
# fp64 error of the decimal read back (a tie, 0.125 printed as 0.12, sits on the half). A printed
# x / 4 (a ZeRO shard of 4 ranks) against the printed x divided by 4: (1 + 1 / 4) times it.
PRINTED_HUNDREDTHS_ABS = 0.005 + FP64_REORDER
PRINTED_QUARTER_PAIR_ABS = (1 + 1 / 4) * PRINTED_HUNDREDTHS_ABS
# A rate stored to 0.1 (TFLOP/s in a device file): half its last digit, plus the same fp64 error.
PRINTED_TENTHS_ABS = 0.05 + FP64_REORDER
# The golden-ratio blend (megatronish.data.blend.assign): how many of N positions fall in a
# dataset's interval is within about the number of terms of N's Zeckendorf sum (Ostrowski's
# bound, every partial quotient of the golden ratio being 1), at most log_phi(N) / 2 = 9.6 at
# N = 10^4: 10 samples.
BLEND_COUNT_ABS = 10
# A count written in a test as an approximation (gpt2-1.3b's 1,313,722,368 parameters as
# 1.3136e9, 9.3e-5 below): 1e-3; a block counted twice or not at all moves it by 3.8%.
WRITTEN_COUNT_REL = 1e-3
# The cost model's GEMM time against its FLOPs over the rate: a kernel's fixed overhead (4 us)
# against an 8192^3 GEMM's >= 0.6 ms, and peak rates published to four digits: under 1%.
GEMM_OVERHEAD_REL = 0.01
# What the cost model claims, not a rounding: its step times are within 20% of every published
# run's (the median within 10%) and 15% of the A100 ones (Korthikanti et al.'s measured
# iterations among them).
PUBLISHED_STEP_REL = 0.20
PUBLISHED_MEDIAN_REL = 0.10
PUBLISHED_ITERATION_REL = 0.15
# The plan's model state (weights, gradients, AdamW) against the bytes a rank holds: the buckets'
# padding to a multiple of dp and the parameters kept whole are not in its count: 5%.
MODEL_STATE_ESTIMATE_REL = 0.05
# A timed or traced step against its parts (phases; compute, exposed communication, bubble) on a
# shared CPU host: the host's time between the timed events is in no part: a tenth of the step.
TRACE_PARTS_REL = 0.1
# A checkpoint's fp8 step-2 weights continued in fp32 or bf16 against the fp8 run's step 3: fp8's
# and bf16's roundings move the loss by about 1e-4, a fresh model's loss is 3% higher and step
# 2's 1.3%: 5e-3 tells them apart.
FP8_CONTINUED_REL = 5e-3
# A difference that says two fp32 results compute different things (a window left out, a mask,
# micro-batches of unequal counts): 1e-3, 50 times FP32_DECODE_ABS and 100 times FP32_REORDER,
# so no rounding above reaches it.
BEYOND_ROUNDING = 1e-3

# The chunked gated delta rule (fp32) against its float64 recurrence: each output is a chain of
# at most 4 GEMMs (W or U, V' = U - W S, then O or the next state; the backward's dR, dT, dA and
# dK likewise), each a sum of at most 64 + d <= 192 terms (a chunk's tokens, or the head dim 128
# and the chunk): 4 reordered_sum_bound(192) = 9.2e-5, relative to the largest magnitude of the
# compared tensor (the terms are of its size with l2-normalized q and k and beta, e^g <= 1):
# 1e-4.
GATED_DELTA_REL = 1e-4

# Gated DeltaNet (the whole layer) against transformers' Qwen3_5GatedDeltaNet: two chunked fp32
# evaluations of the gated delta rule, each within GATED_DELTA_REL of the exact rule (ours by
# triangular solves, theirs by a row-by-row inverse), hence within 2 GATED_DELTA_REL of each
# other; the projections (32 terms), the convolution (4 taps) and the gated norm around it add
# FP32_REORDER-sized terms, far below: 2e-4.
GATED_DELTANET_REL = 2 * GATED_DELTA_REL

# RL log-probabilities (tests/rl) against transformers' log_softmax gathered at the tokens: the
# issue's bound. A log-probability is logit - max - log sum exp of fp32 logits ~1 from a few
# hundred-term fp32 GEMMs (reordered_sum_bound(200) = 2.4e-5 relative to the terms' magnitudes,
# in practice ~1e-6): 1e-5 absolute holds it at every layout.
RL_LOGPROB_ABS = 1e-5
# A step's gradients at another packing or layout against one sequence a row at tp 1: the same
# per-token terms summed in another order over rows and ranks, each gradient a sum of ~1e2
# token terms: reordered_sum_bound(100) = 1.2e-5 relative to its magnitude; the grad norm, a
# sum of squares of those, moves by no more.
RL_GRAD_REL = reordered_sum_bound(100)

# Muon against torch.optim.Muon (tests/optim/test_muon.py): both run Newton-Schulz in bf16
# (u = 2^-8), so the reference's own curve is only as exact as its roundings. Its noise floor,
# measured by moving every gradient by 1e-7 relative (reference_curve's perturb) over the 20
# steps of the tiny Llama (GQA) and Qwen3 (q/k norms): losses 1e-5, gradient norms 3.3e-4
# relative. The bounds are that floor x 10 (the losses' rounded up to the 3e-4 that 3e-5, the
# floor of a longer run, gives); q, k and v orthogonalized as one fused matrix moves the
# Llama's loss by 5e-4 at step 3 already.
MUON_CURVE_REL = 3e-4
MUON_NORM_REL = 3.3e-3
# QK-clip's max_attn_logit (the largest logit of any head) under Muon: the same reference's
# noise floor, measured the same way (every gradient moved by +-1e-7 and 2e-7 relative) over
# the layout runs' 5 steps of the tiny Llama at tau 0.045: 4.2e-4 relative (0 at step 1, before
# any update); the bound is that floor x 10. A max over heads follows one weight's rounding
# where a loss averages many.
MUON_LOGIT_REL = 4.2e-3
