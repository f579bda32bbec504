"""Compute time of one transformer layer, and of the embedding and the output layer, for one
micro-batch on one rank: forward, backward and what recompute reruns (``LayerTime``), from
the GEMM shapes, the attention's FLOPs and the bytes of the memory-bound ops (timed by
accounting.roofline). Communication is not here (accounting.comm_time).

Legend: T = b s / cp tokens a rank holds, h hidden, a heads and k kv heads of d dims, t tp,
f d_ff, V the padded vocab, c bytes a 16-bit (bf16) or fp32 activation element. A GEMM
[m, k] x [k, n] forward has two of the same FLOPs backward: the input gradient [m, n] x [n, k]
and the weight gradient [k, m] x [m, n]; under model.lora the input gradient alone (the base
weights are frozen: layers.linear computes no gradient for them; the adapters' small GEMMs are
not timed).

GEMMs a layer forward: qkv [T, h] x [h, (a + 2k) d / t] (a more with Qwen3.5's query gate),
projection [T, a d / t] x [a d / t, h] (multi-head latent attention and a linear-attention block
their own: each attention kind's ``gemms`` in accounting.components), MLP up [T, h] x [h, f / t]
(llama: gate and up, 2 f / t wide), down [T, f / t] x [f / t, h]; an MoE MLP instead its router
[T, h] x [h, E] and the T top_k routed rows through its E / ep experts (each [rows, h] x [h, f /
t] three times: gate, up, down), a shared expert as a SwiGLU MLP of its own size.

Attention: flash-style (what megatronish runs): 2 b (a / t) (s / cp) s (d + d_v) FLOPs forward
(d_v the value head dim: d but for multi-head latent attention), half
under the causal mask (under a sliding window W the pairs it keeps: roofline.attention_flops),
at the device's attention shares of the peak, 2.5 x the FLOPs backward. "materialized" (what
Megatron-LM ran in 2021-22, before flash attention): the scores [b, a / t, s, s] come from two
batched GEMMs forward (four backward) at GEMM efficiency, and the fused scale-mask-softmax and
the attention dropout stream them through memory: forward read + write (softmax) and read +
write + a 1-byte mask (dropout); backward read mask, gradient and write (dropout), read output,
gradient and write (softmax); a window masks its scores and saves none.

Memory-bound ops forward, in elements of c bytes (N = T / t tokens under sequence parallelism,
else T: the norms, residuals and dropouts run on a rank's share of the sequence):
two norms 2 N h each; after attention and after the MLP bias + dropout + residual, read 2 N h
and write N h each, plus a 1-byte mask each with dropout > 0; the MLP's activation, read + write
T f / t (gelu) or read 2 and write 1 (swiglu); llama's rotary embedding on q and k, read +
write T (a + k) d / t; the heads' layout copies, read + write of q, k, v into [b, a / t, s, d]
and of the attention output back, 2 T (2 a + 2 k) d / t. Backward moves twice the forward's
bytes. Output layer: the final norm; the cross entropy reads the logits and writes their fp32
softmax statistics and the logits' gradient, about (2 c + 8) T V / t bytes. A multi-token
prediction module (model.mtp_depth, on the last stage): its eh_proj [N, 2h] x [2h, h] (replicated
over tp) and three norms 2 N h each (enorm, hnorm, its own), beside a layer and the output
layer timed as above. Embedding: a lookup
forward (read fp32 4 T h, write c T h) and a scatter-add of its gradient backward (read and
write 4 T h).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from megatronish.accounting.collectives.fp8 import train_format
from megatronish.accounting.components import ATTENTION, embedding, gated_deltanet, mlp, norm
from megatronish.accounting.components import moe as moe_cost
from megatronish.accounting.hardware import Device
from megatronish.accounting.roofline import (
    Efficiency,
    attention_flops,
    delta_rule_seconds,
    flash_attention_seconds,
    gemm_time,
    memory_seconds,
)
from megatronish.config import Config, Derived
from megatronish.layers.formats import HIGH_PRECISION
from megatronish.layers.plan import Format


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one micro-batch on one rank: forward, backward, and the extra forward work
    selective (the attention core) and full (the whole layer) recompute add."""

    forward: float
    backward: float
    attention_forward: float

    def total(self, recompute: str) -> float:
        extra = {"full": self.forward, "selective": self.attention_forward}.get(recompute, 0.0)
        return self.forward + self.backward + extra


class _Timer:
    """Roofline times on one device at one activation width; fmt: the numeric format of the
    GEMMs of ``gemm`` asked to run in it (megatronish.layers.formats); frozen: the weights get
    no gradient (model.lora), so backward is the input gradient alone."""

    def __init__(
        self,
        device: Device,
        eff: Efficiency,
        width: int,
        fmt: Format = HIGH_PRECISION,
        frozen: bool = False,
    ):
        self.device, self.bw, self.eff, self.width = device, device.hbm_tb_s * 1e12, eff, width
        self.format, self.frozen = fmt, frozen

    def gemm(
        self, m: int, n: int, k: int, backward: bool = False, batch: int = 1, fp8: bool = False
    ) -> float:
        """One GEMM forward, or its two gradient GEMMs; `batch` of them in one kernel; fp8 (with
        the timer's format fp8): at the fp8 peak, plus the bytes of its casts (the format's)."""
        shapes = [(m, k, n), (k, n, m)][: 1 if self.frozen else 2] if backward else [(m, n, k)]
        fp8 = fp8 and self.format.fp8_gemms
        total = 0.0
        for mm, nn, kk in shapes:
            total += gemm_time(mm, nn, kk, self.device, self.width, self.eff, fp8, batch)[0]
        if fp8:
            nbytes = batch * self.format.cast_bytes(m, n, k, self.width, backward)
            total += memory_seconds(nbytes, self.bw, self.eff, 2)
        return total

    def stream(self, elements: float, kernels: int, extra_bytes: float = 0.0) -> float:
        return memory_seconds(elements * self.width + extra_bytes, self.bw, self.eff, kernels)


def layer_time(
    cfg: Config,
    derived: Derived,
    device: Device,
    eff: Efficiency,
    moe: bool,
    attention: str,
    window: int | None = None,
    mixer: str | None = None,
) -> LayerTime:
    """One transformer layer (an MoE layer when `moe`, attending through a sliding window when
    `window` is set; its attention kind `mixer`, None: the components') for one micro-batch on
    one rank."""
    model, train, tp = cfg.model, cfg.train, derived.tp
    width = 2 if train.bf16_autocast else 4
    timer = _Timer(device, eff, width, train_format(train), model.lora is not None)
    s = train.seq_len // derived.cp
    T, h, hd = train.micro_batch_size * s, model.d_model, derived.head_dim
    heads, kv = model.n_head // tp, derived.n_kv_head // tp
    sp = cfg.parallel.sequence_parallel and tp > 1
    N = T // tp if sp else T
    mixer = mixer or model.components.attention
    gemms = ATTENTION[mixer].gemms(model, derived, T, N)
    f_local = (derived.moe_d_ff if moe else derived.d_ff) // tp
    if not moe:
        gemms += mlp.gemms(model, T, f_local)
    fwd = sum(timer.gemm(*g, fp8=True) for g in gemms)
    bwd = sum(timer.gemm(*g, backward=True, fp8=True) for g in gemms)
    if moe:
        for g in moe_cost.routed_gemms(cfg, derived, T):
            fwd += timer.gemm(g.m, g.n, g.k, batch=g.batch, fp8=g.fp8)
            bwd += timer.gemm(g.m, g.n, g.k, backward=True, batch=g.batch, fp8=g.fp8)
        shared = moe_cost.shared_gemms(cfg, derived, T)
        if shared:
            fwd += sum(timer.gemm(*g, fp8=True) for g in shared)
            bwd += sum(timer.gemm(*g, backward=True, fp8=True) for g in shared)
        # Permute the routed rows out and back, forward; twice backward.
        routed = moe_cost.permuted_elements(cfg, T)
        fwd += timer.stream(4 * routed, 4)
        bwd += timer.stream(8 * routed, 8)
    mask = 1 if model.dropout > 0 else 0
    act = moe_cost.activation_elements if moe else partial(mlp.activation_elements, model)
    if mixer == "gated_deltanet":
        attn_fwd, attn_bwd = _delta_rule(cfg, derived, device, eff, T, timer.width)
        mixing, mixing_kernels = gated_deltanet.stream_elements(model, derived, T), 5
    else:
        attn_fwd, attn_bwd = _attention(cfg, derived, timer, device, eff, attention, s, window)
        mixing = embedding.rope_elements(model, T, heads, kv, hd)
        mixing += 2 * T * (2 * heads + 2 * kv) * hd  # [s, b, n, d] <-> [b, n, s, d], in and out
        mixing_kernels = embedding.rope_kernels(model)
    residuals = N * h * (3 + 3)  # bias + dropout + residual twice: read 2 N h, write N h
    elems = norm.stream_elements(model, N) + residuals + act(T, f_local) + mixing
    kernels = norm.per_block(model) + 4 + mixing_kernels
    elementwise = timer.stream(elems, kernels, extra_bytes=2 * mask * N * h)
    fwd += attn_fwd + elementwise
    bwd += attn_bwd + 2 * elementwise
    return LayerTime(forward=fwd, backward=bwd, attention_forward=attn_fwd)


FP8_LINEARS = {"qkv", "proj", "up", "down", "shared_up", "shared_down", "kv_up"} | {
    f"linear_{name}" for name in ("qkv", "z", "b", "a", "out")
}
"""The linears of ``linear_shapes`` whose GEMMs are fp8 under train.precision fp8 (not the output
layer, "head", nor multi-head latent attention's replicated down-projections)."""


def linear_gemms(cfg: Config, derived: Derived, device: Device, eff: Efficiency) -> dict:
    """Seconds of the tensor-parallel linears' GEMMs of one micro-batch on one rank, the GEMMs
    a decomposed tp collective runs under (accounting.tp_overlap): forward, one call each, of
    each of ``linear_shapes``' (the attention's, up: gpt2's up, llama's gate and up, down, head:
    the output layer, shared_up and shared_down: an MoE layer's shared expert, when it has
    one), and linear_in, a linear-attention block's four input projections together (they
    share one gathered input); and the backward pair (input and weight gradient) of proj,
    down, shared_down and linear_out, which the all-gather of their output gradient runs
    under."""
    train = cfg.train
    width, frozen = 2 if train.bf16_autocast else 4, cfg.model.lora is not None
    timer = _Timer(device, eff, width, train_format(train), frozen)
    shapes = linear_shapes(cfg, derived)
    gemms = {name: timer.gemm(*shape, fp8=name in FP8_LINEARS) for name, shape in shapes.items()}
    if "linear_out" in shapes:  # one gathered input, four projections run on it chunk by chunk
        gemms["linear_in"] = sum(gemms[f"linear_{name}"] for name in ("qkv", "z", "b", "a"))
    for name in ("proj", "down", "shared_down", "linear_out"):
        if name in shapes:
            gemms[f"{name}_backward"] = timer.gemm(*shapes[name], True, fp8=name in FP8_LINEARS)
    return gemms


def linear_shapes(cfg: Config, derived: Derived) -> dict[str, tuple[int, int, int]]:
    """(m, n, k) of the forward GEMM of each linear of one micro-batch on one rank, named as
    ``linear_gemms`` names them: each attention kind's among the blocks (its component's
    ``gemm_names``: a hybrid's full-attention blocks' qkv and proj, its linear-attention
    blocks' linear_*), the dense MLP's, the output layer's and the shared expert's."""
    model, train, tp = cfg.model, cfg.train, derived.tp
    T, h = train.micro_batch_size * train.seq_len // derived.cp, model.d_model
    N = T // tp if cfg.parallel.sequence_parallel and tp > 1 else T
    shapes = {}
    for kind in dict.fromkeys(model.block_attention(i) for i in range(model.n_layer)):
        cost = ATTENTION[kind]
        shapes.update(zip(cost.gemm_names(model), cost.gemms(model, derived, T, N)))
    up, down = mlp.gemms(model, T, derived.d_ff // tp)
    shapes.update(up=up, down=down, head=(T, derived.padded_vocab_size // tp, h))
    shapes.update(zip(("shared_up", "shared_down"), moe_cost.shared_gemms(cfg, derived, T)))
    return shapes


def gemm_table(cfg: Config, derived: Derived, device: Device, eff: Efficiency) -> list[dict]:
    """The forward and gradient GEMMs of each linear of one micro-batch on one rank (pass
    forward, input_grad or weight_grad, none under model.lora; their m, n, k), with the share of
    the peak each reaches and whether it is memory-bound: what plan reports of a layer's
    GEMMs."""
    width, fp8 = 2 if cfg.train.bf16_autocast else 4, cfg.train.precision == "fp8"
    rows = []
    for name, (m, n, k) in linear_shapes(cfg, derived).items():
        low = fp8 and name in FP8_LINEARS
        passes = [("forward", (m, n, k)), ("input_grad", (m, k, n)), ("weight_grad", (k, n, m))]
        for kind, (mm, nn, kk) in passes[: 2 if cfg.model.lora is not None else 3]:
            seconds, bound = gemm_time(mm, nn, kk, device, width, eff, low)
            peak = device.fp8_tflops * 1e12 if low else device.peak_flops
            share = 2.0 * mm * nn * kk / seconds / peak
            rows.append(
                dict(gemm=name, pass_=kind, m=mm, n=nn, k=kk, share=share, memory_bound=bound)
            )
    return rows


def _attention(
    cfg: Config,
    derived: Derived,
    timer: _Timer,
    device: Device,
    eff: Efficiency,
    kind: str,
    s: int,
    window: int | None,
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core of one layer."""
    model, train, tp = cfg.model, cfg.train, derived.tp
    b, heads, hd = train.micro_batch_size, model.n_head // tp, derived.head_dim
    if kind == "flash":
        flops = attention_flops(b, heads, s, train.seq_len, hd, True, window, derived.v_head_dim)
        return (
            flash_attention_seconds(flops, device, eff, backward=False),
            flash_attention_seconds(flops, device, eff, backward=True),
        )
    if kind != "materialized":
        raise ValueError(f"attention {kind!r}: expected flash or materialized")
    batch, full = b * heads, train.seq_len
    forward = timer.gemm(s, full, hd, batch=batch) + timer.gemm(s, hd, full, batch=batch)
    backward = timer.gemm(s, full, hd, True, batch) + timer.gemm(s, hd, full, True, batch)
    scores = b * heads * s * full
    mask = scores if model.dropout > 0 else 0
    forward += timer.stream(scores * (2 + (2 if mask else 0)), 2, extra_bytes=mask)
    backward += timer.stream(scores * ((2 if mask else 0) + 3), 2, extra_bytes=mask)
    return forward, backward


def _delta_rule(
    cfg: Config, derived: Derived, device: Device, eff: Efficiency, T: int, width: int
) -> tuple[float, float]:
    """(forward, backward) seconds of one linear-attention layer's chunked delta rule on T
    tokens of one tp rank (its own kernel kind: roofline.delta_rule_seconds)."""
    model = cfg.model
    flops = T * gated_deltanet.rule_flops_per_token(model) / derived.tp
    nbytes = gated_deltanet.rule_bytes(model, derived, T, width)
    return (
        delta_rule_seconds(flops, nbytes, device, eff, backward=False),
        delta_rule_seconds(flops, nbytes, device, eff, backward=True),
    )


def embedding_time(cfg: Config, derived: Derived, device: Device, eff: Efficiency) -> LayerTime:
    """The token (and position) embedding of one micro-batch on the first stage."""
    width = 2 if cfg.train.bf16_autocast else 4
    timer = _Timer(device, eff, width)
    T, h = cfg.train.micro_batch_size * cfg.train.seq_len // derived.cp, cfg.model.d_model
    return LayerTime(
        forward=timer.stream(T * h, 1, extra_bytes=4 * T * h),
        backward=timer.stream(0, 1, extra_bytes=8 * T * h),
        attention_forward=0.0,
    )


def output_time(cfg: Config, derived: Derived, device: Device, eff: Efficiency) -> LayerTime:
    """The final norm, the output layer and the cross entropy of one micro-batch on the last
    stage (full recompute does not rerun them)."""
    width = 2 if cfg.train.bf16_autocast else 4
    timer = _Timer(device, eff, width, frozen=cfg.model.lora is not None)
    T, h = cfg.train.micro_batch_size * cfg.train.seq_len // derived.cp, cfg.model.d_model
    v_local = derived.padded_vocab_size // derived.tp
    sp = cfg.parallel.sequence_parallel and derived.tp > 1
    norm = timer.stream(2 * (T // derived.tp if sp else T) * h, 1)
    loss = timer.stream(0, 3, extra_bytes=(2 * width + 8) * T * v_local)
    return LayerTime(
        forward=timer.gemm(T, v_local, h) + norm + loss / 2,
        backward=timer.gemm(T, v_local, h, backward=True) + 2 * norm + loss / 2,
        attention_forward=0.0,
    )


def mtp_projection_time(
    cfg: Config, derived: Derived, device: Device, eff: Efficiency
) -> LayerTime:
    """A multi-token prediction module's own work of one micro-batch on the last stage: its
    three norms and eh_proj (2h -> h, on the rank's sequence share under sequence parallelism);
    full recompute does not rerun them (only the module's block)."""
    width = 2 if cfg.train.bf16_autocast else 4
    timer = _Timer(device, eff, width, frozen=cfg.model.lora is not None)
    T, h = cfg.train.micro_batch_size * cfg.train.seq_len // derived.cp, cfg.model.d_model
    N = T // derived.tp if cfg.parallel.sequence_parallel and derived.tp > 1 else T
    norms = timer.stream(3 * 2 * N * h, 3)
    return LayerTime(
        forward=timer.gemm(N, h, 2 * h) + norms,
        backward=timer.gemm(N, h, 2 * h, backward=True) + 2 * norms,
        attention_forward=0.0,
    )
