"""The Triton kernels (megatronish_kernels) against the torch reference and float64 math.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels
are imported), in fp32 and at tiny odd shapes whose sizes are not multiples of the blocks. The
bf16 checks need CUDA and are marked `cuda`. Cross entropy has its own module.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from megatronish import ops
from megatronish.ops import reference
from megatronish.ops.rope import PLAIN, Llama3Scaling, RopeSpec, YarnScaling
from tests.conftest import finish
from tests.kernel_env import INTERPRET as _INTERPRET
from tests.kernel_env import kernels
from tests.tolerances import KERNEL_ABS, KERNEL_REL, KERNEL_ROPE_ABS

pytestmark = pytest.mark.usefixtures("interpreter_env")  # tests/conftest.py
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO_ROOT = Path(__file__).resolve().parents[2]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    """A fresh random leaf tensor that requires grad (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
    return x.to(device=DEVICE, dtype=dtype).requires_grad_(True)


def outputs_and_grads(fn, inputs, upstream):
    """fn(*inputs) and the gradients of <fn(*inputs), upstream> for every tensor input."""
    out = fn(*inputs)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [out, *torch.autograd.grad(out, tensors, upstream)]


def as64(inputs):
    return [
        t.detach().double().requires_grad_(True)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
        else t
        for t in inputs
    ]


def check_op(kernel, ref32, ref64, inputs, atol=KERNEL_ABS, rtol=KERNEL_REL):
    """Output and every input gradient of kernel match ref32 (same inputs) and ref64 (float64
    copies of the inputs), for a random upstream gradient."""
    out = ref32(*inputs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out)
    ours = outputs_and_grads(kernel, inputs, upstream)
    theirs32 = outputs_and_grads(ref32, inputs, upstream)
    theirs64 = outputs_and_grads(ref64, as64(inputs), upstream.double())
    assert len(ours) == len(theirs32) == len(theirs64)
    for index, (a, b, c) in enumerate(zip(ours, theirs32, theirs64, strict=True)):
        what = "output" if index == 0 else f"gradient {index}"
        assert a.dtype == b.dtype, what
        for want, name in ((b, "fp32"), (c, "fp64")):
            torch.testing.assert_close(
                a.to(want.dtype), want, atol=atol, rtol=rtol, msg=f"{what} vs {name} reference"
            )


# float64 references, written out from the definitions.


def rms_norm64(x, weight, eps, offset=0.0):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)


def layer_norm64(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * weight
    return y + bias if bias is not None else y


def attention64(q, k, v, causal, segments=None, window=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
    hidden = (j > i) if causal else torch.zeros(s, s, dtype=torch.bool, device=q.device)
    if window is not None:  # query i sees key j only when i - j < window
        hidden = hidden | (i - j >= window)
    if segments is not None:
        hidden = hidden | (segments[:, None, :, None] != segments[:, None, None, :])
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


def rope64(x, spec, positions=None):
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = spec.theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    if spec.scaling is not None:  # the scaled frequencies: held to transformers' in tests/ops
        inv_freq = spec.inverse_frequencies(d, x.device).double()
    if positions is None:
        positions = torch.arange(s, device=x.device)
    angles = positions.double()[..., None] * inv_freq  # [s, d/2] or [b, s, d/2]
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = [x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()]
    return torch.cat(rotated, -1) * spec.attention_factor()


def gelu_tanh64(x, bias):
    x = x + bias if bias is not None else x
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# Norms


@pytest.fixture
def few_backward_programs(monkeypatch):
    """The norm backward with 4 programs, so each loops over several rows, as with > 512 rows
    on the GPU (the interpreter is too slow for that many)."""
    norms = sys.modules["megatronish_kernels.norms"]
    monkeypatch.setattr(norms, "persistent_programs", lambda n_rows: min(n_rows, 4))


@pytest.mark.parametrize("shape", [(3, 5, 37), (7, 300), (1, 1)])
def test_rms_norm_matches_reference_and_float64(shape):
    x, w = randn(*shape, seed=1), randn(shape[-1], seed=2)
    check_op(kernels.rms_norm, reference.rms_norm, rms_norm64, [x, w, 1e-5])


def test_rms_norm_with_an_offset_scales_by_offset_plus_weight_in_fp32_and_matches_float64():
    # Gemma 3's and Qwen3.5's 1 + w, w near 0: forward, dx and dw against float64.
    x, w = randn(3, 5, 37, seed=1), randn(37, seed=2, scale=0.1)
    check_op(kernels.rms_norm, reference.rms_norm, rms_norm64, [x, w, 1e-6, 1.0])
    # A bf16 weight: 1 + w is taken in fp32 (as transformers does), not rounded to bf16.
    w16 = w.detach().bfloat16()
    with torch.no_grad():
        got = ops.rms_norm(x, w16, 1e-6, "triton", offset=1.0)
        want = rms_norm64(x.double(), w16.double(), 1e-6, 1.0)
    torch.testing.assert_close(got.double(), want, atol=KERNEL_ABS, rtol=KERNEL_REL)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 37), (7, 300)])
def test_layer_norm_matches_reference_and_float64(shape, with_bias):
    x, w = randn(*shape, seed=3, scale=2.0), randn(shape[-1], seed=4)
    bias = randn(shape[-1], seed=5) if with_bias else None
    check_op(kernels.layer_norm, reference.layer_norm, layer_norm64, [x + 0.5, w, bias, 1e-5])


@pytest.mark.parametrize("rms", [True, False])
def test_norm_backward_programs_that_loop_over_rows_sum_weight_grads(few_backward_programs, rms):
    x, w, bias = randn(2, 19, 37, seed=6), randn(37, seed=7), randn(37, seed=8)
    if rms:
        check_op(kernels.rms_norm, reference.rms_norm, rms_norm64, [x, w, 1e-5])
    else:
        check_op(kernels.layer_norm, reference.layer_norm, layer_norm64, [x, w, bias, 1e-5])


def test_norm_weight_gradient_is_deterministic(few_backward_programs):
    x, w = randn(41, 37, seed=6), randn(37, seed=7)
    first = torch.autograd.grad(kernels.rms_norm(x, w, 1e-6).sum(), w)[0]
    second = torch.autograd.grad(kernels.rms_norm(x, w, 1e-6).sum(), w)[0]
    assert torch.equal(first, second)


def test_norm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(randn(4, 37, seed=8), randn(36, seed=9), 1e-5)


# RoPE, SwiGLU, bias + GELU


# Head dim 16 at theta 10000: llama3 keeps dim pair 0, blends pairs 1 and 2 and slows the
# others; yarn keeps pair 0, ramps over pairs 1 to 3 and slows the others, and scales by 1.14.
LLAMA3 = RopeSpec(10000.0, Llama3Scaling(4.0, 1.0, 4.0, 64))
YARN = RopeSpec(10000.0, YarnScaling(4.0, 256))
DOCUMENTS = [[*range(5), *range(8)], list(range(13))]  # positions restart at each document


@pytest.mark.parametrize(
    "shape, spec, positions",
    [
        ((2, 3, 13, 16), PLAIN, None),
        ((1, 2, 7, 10), PLAIN, None),
        ((2, 3, 13, 16), LLAMA3, [3 * i + 5 for i in range(13)]),  # a cp shard's: global
        ((2, 3, 13, 16), YARN, DOCUMENTS),
    ],
    ids=["plain", "plain head dim 10", "llama3 at cp positions", "yarn within documents"],
)
def test_rope_matches_reference_and_float64(shape, spec, positions):
    at = None if positions is None else torch.tensor(positions, device=DEVICE)
    check_op(
        lambda x: ops.rope(x, spec, backend="triton", positions=at),
        lambda x: reference.rope(x, spec, positions=at),
        lambda x: rope64(x, spec, at),
        [randn(*shape, seed=10)],
        atol=KERNEL_ROPE_ABS,
    )


def test_rope_rejects_an_odd_head_dim_and_a_table_of_another_shape():
    table = torch.zeros(4, 3, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        kernels.rope(randn(1, 1, 4, 7, seed=11), table, table)
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.rope(randn(1, 1, 4, 8, seed=11), table, table)


def test_swiglu_matches_reference_and_float64():
    gate, up = randn(3, 5, 37, seed=12, scale=3.0), randn(3, 5, 37, seed=13)
    check_op(kernels.swiglu, reference.swiglu, reference.swiglu, [gate, up])


def test_geglu_matches_reference_and_float64():
    gate, up = randn(3, 5, 37, seed=14, scale=3.0), randn(3, 5, 37, seed=15)
    check_op(kernels.geglu, reference.geglu, reference.geglu, [gate, up])


@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_matches_reference_and_float64(with_bias):
    x = randn(4, 3, 37, seed=14, scale=3.0)
    bias = randn(37, seed=15) if with_bias else None
    check_op(kernels.bias_gelu, reference.bias_gelu, gelu_tanh64, [x, bias])


def test_elementwise_kernels_cover_more_than_one_block():
    x = randn(3, 1100, seed=16)  # 3300 elements: four 1024-element blocks, the last partial
    bias = randn(1100, seed=17)
    check_op(kernels.bias_gelu, reference.bias_gelu, gelu_tanh64, [x, bias])


# Attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "n_head, n_kv_head, seq_len, head_dim",
    [(4, 2, 13, 16), (4, 2, 40, 32), (2, 2, 40, 16), (4, 1, 33, 16)],
)
def test_attention_matches_reference_and_float64(n_head, n_kv_head, seq_len, head_dim, causal):
    q = randn(2, n_head, seq_len, head_dim, seed=20)
    k = randn(2, n_kv_head, seq_len, head_dim, seed=21)
    v = randn(2, n_kv_head, seq_len, head_dim, seed=22)
    check_op(kernels.attention, reference.attention, attention64, [q, k, v, causal])


@pytest.mark.parametrize("documents", [False, True])
def test_attention_under_a_sliding_window_matches_reference_and_float64(documents):
    # 40 positions over the interpreter's tiles (forward and dQ 32 x 16, dK/dV 16 x 32) and a
    # window of 7: query blocks skip whole key blocks and mask those the window's edge crosses;
    # with documents (breaks at 13 and 30) both masks at once. Two query heads on one kv head.
    q = randn(1, 2, 40, 16, seed=20)
    k, v = randn(1, 1, 40, 16, seed=21), randn(1, 1, 40, 16, seed=22)
    segments = None
    if documents:
        segments = torch.zeros(1, 40, dtype=torch.int32, device=DEVICE)
        segments[0, 13:], segments[0, 30:] = 1, 2
    check_op(kernels.attention, reference.attention, attention64, [q, k, v, True, segments, 7])
    with torch.no_grad():  # megatronish.ops hands the window to the kernel
        dispatched = ops.attention(q, k, v, True, "triton", segments, 7)
        assert torch.equal(dispatched, kernels.attention(q, k, v, True, segments, 7))


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # the NaN positions' own
@pytest.mark.parametrize("poisoned", ["early", "late"])
def test_the_triton_kernels_never_read_the_blocks_outside_every_window(poisoned):
    # 96 positions, a window of 8; q, k, v and the output gradient are NaN at positions 0..31
    # (early) or 64..95 (late). Early: the query blocks from 64 on (forward and dQ: 32 rows,
    # keys from 57 on) must skip the key blocks below 48. Late: the keys below 32 (dK/dV: one
    # block of 32, seen by the queries up to 38) must skip the query blocks from 48 on. A
    # block that were read would bring NaN in.
    q, k, v = (
        randn(1, 2, 96, 16, seed=23),
        randn(1, 1, 96, 16, seed=24),
        randn(1, 1, 96, 16, seed=25),
    )
    dout = torch.randn(1, 2, 96, 16, generator=torch.Generator().manual_seed(26))
    clean = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    nan = [x.detach().clone() for x in (q, k, v, dout)]
    for x in nan:
        x[:, :, slice(0, 32) if poisoned == "early" else slice(64, None)] = float("nan")
    leaves = [x.requires_grad_(True) for x in nan[:3]]
    got = outputs_and_grads(lambda *a: kernels.attention(*a, True, None, 8), leaves, nan[3])
    want = outputs_and_grads(lambda *a: attention64(*a, True, None, 8), as64(clean), dout.double())
    checked = (0, 1) if poisoned == "early" else (2, 3)  # out and dq, or dk and dv
    rows = slice(64, None) if poisoned == "early" else slice(0, 32)
    for index in checked:
        torch.testing.assert_close(
            got[index][:, :, rows].double(),
            want[index][:, :, rows],
            atol=KERNEL_ABS,
            rtol=KERNEL_REL,
        )


def test_a_ring_block_under_a_window_its_queries_past_its_keys_matches_the_float64_block():
    # A ring block: 40 queries 40 positions after its 40 keys (offset 40), a window of 20 and
    # documents: query i sees keys j > i + 20 of its document, the queries from 19 on none
    # (o 0, lse -inf). megatronish.context.blocks hands the window and offset to the kernels.
    from megatronish.context import blocks

    q, dout = randn(1, 2, 40, 16, seed=27), randn(1, 2, 40, 16, seed=30).detach()
    k, v = randn(1, 1, 40, 16, seed=28), randn(1, 1, 40, 16, seed=29)
    segments = torch.zeros(1, 40, dtype=torch.int32, device=DEVICE)
    segments[0, 25:] = 1
    args = (False, (segments, segments), 20, 40)
    got_out, got_lse = blocks.triton_forward(q.detach(), k.detach(), v.detach(), *args)
    exact = [x.detach().double() for x in (q, k, v)]
    want_out, want_lse = blocks.torch_forward(*exact, *args)
    assert torch.equal(got_lse.isinf(), want_lse.isinf()) and want_lse.isinf().any()
    torch.testing.assert_close(got_out.double(), want_out, atol=KERNEL_ABS, rtol=KERNEL_REL)
    seen = ~want_lse.isinf()
    torch.testing.assert_close(
        got_lse.double()[seen], want_lse[seen], atol=KERNEL_ABS, rtol=KERNEL_REL
    )
    lse = want_lse.masked_fill(~seen, 0.0)  # a ring's final lse: finite on every row
    got = blocks.triton_backward(q, k, v, want_out.float(), lse.float(), dout, *args)
    want = blocks.torch_backward(*exact, want_out, lse, dout.double(), *args)
    for name, a, b in zip(["dq", "dk", "dv"], got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=KERNEL_ABS, rtol=KERNEL_REL, msg=name)


def test_attention_accepts_non_contiguous_inputs():
    # [b, s, n, d] projections viewed as [b, n, s, d], as a model produces them.
    q = randn(1, 21, 4, 16, seed=23).transpose(1, 2)
    k = randn(1, 21, 2, 16, seed=24).transpose(1, 2)
    v = randn(1, 21, 2, 16, seed=25).transpose(1, 2)
    assert not q.is_contiguous()
    check_op(kernels.attention, reference.attention, attention64, [q, k, v, True])


@pytest.mark.parametrize("head_dim", [24, 256])
def test_attention_rejects_unsupported_head_dims(head_dim):
    q = randn(1, 2, 5, head_dim, seed=26)
    with pytest.raises(ValueError, match="head dim"):
        kernels.attention(q, q, q, True)


def test_attention_rejects_kv_heads_that_do_not_divide_heads():
    q, k = randn(1, 3, 5, 16, seed=27), randn(1, 2, 5, 16, seed=28)
    with pytest.raises(ValueError, match="n_kv_head"):
        kernels.attention(q, k, k, True)


# Dispatch through megatronish.ops


def _grad_fn_name(tensor: torch.Tensor) -> str:
    return type(tensor.grad_fn).__name__


@pytest.mark.parametrize(
    "op, make_inputs, function_name",
    [
        ("rms_norm", lambda: [randn(3, 37, seed=30), randn(37, seed=31), 1e-5], "_NormFunction"),
        (
            "layer_norm",
            lambda: [randn(3, 37, seed=32), randn(37, seed=33), randn(37, seed=34), 1e-5],
            "_NormFunction",
        ),
        ("rope", lambda: [randn(1, 2, 9, 16, seed=35), YARN], "_RopeFunction"),
        ("swiglu", lambda: [randn(5, 37, seed=36), randn(5, 37, seed=37)], "_SwiGLUFunction"),
        ("bias_gelu", lambda: [randn(5, 37, seed=38), randn(37, seed=39)], "_BiasGeluFunction"),
        (
            "attention",
            lambda: [
                randn(1, 4, 13, 16, seed=40),
                randn(1, 2, 13, 16, seed=41),
                randn(1, 2, 13, 16, seed=42),
                True,
            ],
            "_AttentionFunction",
        ),  # fmt: skip
    ],
)
def test_ops_backend_triton_dispatches_to_the_kernel_and_matches_torch(
    op, make_inputs, function_name
):
    inputs = make_inputs()
    ours = getattr(ops, op)(*inputs, backend="triton")
    assert _grad_fn_name(ours).startswith(function_name), _grad_fn_name(ours)
    upstream = torch.randn(ours.shape, generator=torch.Generator().manual_seed(5)).to(ours)
    got = outputs_and_grads(lambda *a: getattr(ops, op)(*a, backend="triton"), inputs, upstream)
    want = outputs_and_grads(lambda *a: getattr(ops, op)(*a, backend="torch"), inputs, upstream)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=KERNEL_ABS, rtol=KERNEL_REL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_backend_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = randn(3, 8, seed=43), randn(8, seed=44)
    with pytest.raises(ops.BackendUnavailable, match="TRITON_INTERPRET"):
        ops.rms_norm(x, w, 1e-5, backend="triton")
    assert ops.rms_norm(x, w, 1e-5, backend="auto").grad_fn is not None  # auto: torch on CPU


BENCH_TEST = "test_bench_script_checks_every_kernel_and_runs_its_pipeline"


def _bench_command(tmp_path_factory):
    # On CPU the default run is the interpreter check plus a tiny dry run of the whole
    # benchmark; on CUDA only --check (the real benchmark takes minutes).
    args = ["--check"] if torch.cuda.is_available() else []
    env = {**os.environ, "TRITON_INTERPRET": "1"} if _INTERPRET else dict(os.environ)
    return [sys.executable, str(REPO_ROOT / "scripts" / "bench_kernels.py"), *args], env


# The check of this module that runs in a subprocess, started with the session when its test
# is selected (conftest's side_checks): it takes a core while other tests run here. Compiling
# every kernel for sm_80 and sm_90 is tests/kernels/test_kernel_compile.py's.
SIDE_CHECKS = {BENCH_TEST: _bench_command}


def test_bench_script_checks_every_kernel_and_runs_its_pipeline(side_checks):
    result = finish(side_checks.pop(BENCH_TEST), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checked = [line for line in result.stdout.splitlines() if "max |ours - torch|" in line]
    names = ("rms_norm", "layer_norm", "rope", "swiglu", "bias_gelu", "attention", "cross_entropy")
    assert [line.split()[0] for line in checked] == list(names)
    assert all(line.endswith("ok") for line in checked)
    if not torch.cuda.is_available():
        assert "CUDA is not available" in result.stdout
        lines = result.stdout.splitlines()
        assert any(line.startswith("target") for line in lines), "no targets table"


# bf16 on CUDA: error against fp64 within twice torch's own bf16 error (plus a floor).


def _check_bf16(kernel, ref, make_inputs, floor=2e-2):
    inputs32 = make_inputs(torch.float32)
    inputs16 = [
        t.detach().bfloat16().requires_grad_(True) if isinstance(t, torch.Tensor) else t
        for t in inputs32
    ]
    exact_inputs = as64(inputs16)  # the same bf16-rounded values, in float64
    out = ref(*exact_inputs)
    upstream = torch.randn(out.shape, device=DEVICE, dtype=torch.float64)
    exact = outputs_and_grads(ref, exact_inputs, upstream)
    ours = outputs_and_grads(kernel, inputs16, upstream.bfloat16())
    torch16 = outputs_and_grads(ref, inputs16, upstream.bfloat16())
    for a, b, c in zip(ours, torch16, exact, strict=True):
        assert a.dtype == torch.bfloat16
        ours_err = (a.double() - c).abs().max().item()
        torch_err = (b.double() - c).abs().max().item()
        assert ours_err <= 2 * torch_err + floor, (ours_err, torch_err)


@pytest.mark.parametrize(
    "name",
    [
        "rms_norm",
        "layer_norm",
        "rope",
        "swiglu",
        "geglu",
        "bias_gelu",
        "attention",
        "attention_nc",
        "attention_window",
    ],
)
@pytest.mark.cuda
@requires_cuda
def test_bf16_kernels_on_cuda_are_as_accurate_as_torch(name):
    h, s = 1000, 300

    def pair(dt):
        return [randn(64, h, seed=56, dtype=dt), randn(64, h, seed=57, dtype=dt)]

    def norm_inputs(dt, bias):
        w, b = randn(h, seed=53, dtype=dt), randn(h, seed=54, dtype=dt)
        return [randn(64, h, seed=52, dtype=dt), w, *([b] if bias else []), 1e-5]

    def attention_inputs(dt, causal):
        q = randn(2, 8, s, 128, seed=60, dtype=dt)
        return [
            q,
            randn(2, 2, s, 128, seed=61, dtype=dt),
            randn(2, 2, s, 128, seed=62, dtype=dt),
            causal,
        ]

    makers = {
        "rms_norm": (kernels.rms_norm, reference.rms_norm, lambda dt: norm_inputs(dt, False)),
        "layer_norm": (kernels.layer_norm, reference.layer_norm, lambda dt: norm_inputs(dt, True)),
        "rope": (
            lambda x: ops.rope(x, YARN, backend="triton"),
            lambda x: reference.rope(x, YARN),
            lambda dt: [randn(2, 4, s, 128, seed=55, dtype=dt)],
        ),
        "swiglu": (kernels.swiglu, reference.swiglu, pair),
        "geglu": (kernels.geglu, reference.geglu, pair),
        "bias_gelu": (
            kernels.bias_gelu,
            reference.bias_gelu,
            lambda dt: [pair(dt)[0], randn(h, seed=59, dtype=dt)],
        ),
        "attention": (
            kernels.attention,
            reference.attention,
            lambda dt: attention_inputs(dt, True),
        ),
        "attention_nc": (
            kernels.attention,
            reference.attention,
            lambda dt: attention_inputs(dt, False),
        ),
        "attention_window": (  # a window of 100 of 300: whole key blocks skipped
            lambda q, k, v, causal: kernels.attention(q, k, v, causal, None, 100),
            lambda q, k, v, causal: reference.attention(q, k, v, causal, None, 100),
            lambda dt: attention_inputs(dt, True),
        ),
    }
    kernel, ref, make_inputs = makers[name]
    _check_bf16(kernel, ref, make_inputs)
