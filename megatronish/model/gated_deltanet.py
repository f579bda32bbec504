"""Gated DeltaNet, the linear attention of Qwen3.5's hybrid blocks (model.layer_types), as
transformers' Qwen3_5GatedDeltaNet computes it:

  x -> in_proj_qkv (q, k, v), in_proj_z (the output gate), in_proj_b (beta), in_proj_a (decay);
  q, k, v -> causal depthwise conv1d of linear_conv_kernel_dim, SiLU;
  g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b);
  o = the gated delta rule (ops.gated_delta_rule, q and k L2-normalized, scale 1/sqrt(d_k));
  out_proj(RMSNorm(o) * SiLU(z)), the norm over each value head with one weight of d_v.

Tensor parallelism splits the heads: the four input projections are column-parallel, the rows
of in_proj_qkv ordered by key head so that rank r's contiguous block holds its key heads' q and
k rows and their value heads' v rows (per key head i: q_i, k_i, then v of value heads i r ..
i r + r - 1, r = h_v / h_k; `qkv_rows` puts transformers' [q; k; v] rows in this order), the
convolution's channels the same way; z, b, a, A_log and dt_bias split by value head; out_proj
is row-parallel; the gated norm's weight is replicated.

Under sequence parallelism the input is gathered once for the four projections and the output
reduce-scattered, as for attention. Under document masks (data.document_mask) the convolution
does not reach across a document start and the recurrent state restarts at each.

Shapes (legend in megatronish.model): b batch, s sequence, h d_model, t tp size; k key heads
(model.linear_num_key_heads), v value heads (linear_num_value_heads), e and f their head dims,
c = k (2 e) + v f the convolution's channels, K the kernel width.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.config import ModelConfig
from megatronish.context import Documents
from megatronish.context.state_pass import neighbour_tails, zigzag_recurrence
from megatronish.distributed.ring import GroupRing
from megatronish.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_parallel,
    shared_input_linears,
)
from megatronish.model.norm import Norm
from megatronish.model.plan import BlockPlan
from megatronish.model.recompute import checkpoint
from megatronish.ops.gated_delta import gated_delta_rule


def qkv_rows(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> torch.Tensor:
    """The rows of transformers' in_proj_qkv (and conv1d channels), [q of every key head; k of
    every key head; v of every value head], in our order (grouped by key head): ours =
    theirs[qkv_rows(...)]."""
    per_key = value_heads // key_heads
    q = torch.arange(key_heads * key_dim).view(key_heads, key_dim)
    k = q + key_heads * key_dim
    v = torch.arange(value_heads * value_dim).view(key_heads, per_key * value_dim)
    return torch.cat([q, k, v + 2 * key_heads * key_dim], dim=1).flatten()


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    segments: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    tail_segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution: x [b, c/t, s], weight [c/t, K] -> [b, c/t, s], output t
    the sum over i of weight[:, i] x[t - (K - 1 - i)], the inputs before x read from tail [b,
    c/t, K - 1] (zeros if None); segments [b, s] (each token's document number; tail_segments
    [b, K - 1] the tail's, none of x's if None): no tap reaches another document."""
    width = weight.shape[1]
    tail = x.new_zeros(*x.shape[:2], width - 1) if tail is None else tail
    padded = torch.cat([tail, x], dim=2)  # [b, c/t, K - 1 + s]
    if segments is None:
        return F.conv1d(padded, weight.unsqueeze(1), groups=weight.shape[0])
    if tail_segments is None:
        tail_segments = segments.new_full((segments.shape[0], width - 1), -1)
    document = torch.cat([tail_segments, segments], dim=1)  # [b, K - 1 + s]
    seq, out = x.shape[-1], 0
    for tap in range(width):
        same = document[:, None, tap : tap + seq] == document[:, None, width - 1 :]
        out = out + weight[:, tap, None] * padded[..., tap : tap + seq] * same
    return out


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    backend: str,
    starts: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.gated_delta_rule (q and k L2-normalized) on q, k [b, k/t, s, e], v [b, v/t, s, f],
    g and beta [b, v/t, s] from initial_state [b, v/t, e, f] (zeros if None) -> (o [b, v/t, s,
    f], the final state [b, v/t, e, f] fp32); with starts [b, s] (document starts), each
    document runs alone from a zero state (the tokens before a row's first start from
    initial_state)."""
    rule = functools.partial(
        gated_delta_rule, output_final_state=True, l2norm_qk=True, backend=backend
    )
    if starts is None:
        return rule(q, k, v, g, beta, initial_state)
    rows, finals = [], []
    for row in range(q.shape[0]):
        bounds = [*starts[row].nonzero().flatten().tolist(), q.shape[2]]
        state = None if initial_state is None or bounds[0] == 0 else initial_state[row : row + 1]
        bounds = [0, *bounds] if bounds[0] != 0 else bounds
        parts = []
        for begin, end in zip(bounds[:-1], bounds[1:]):
            out, final = rule(*(x[row : row + 1, :, begin:end] for x in (q, k, v, g, beta)), state)
            parts.append(out)
            state = None  # the next document starts from zeros
        rows.append(torch.cat(parts, dim=2))
        finals.append(final)
    return torch.cat(rows, dim=0), torch.cat(finals, dim=0)


def starts_of(documents: Documents | None) -> torch.Tensor | None:
    """Where documents start (bool [b, s]), None without document masks."""
    return None if documents is None else documents.positions == 0


def piece_segments(documents: Documents | None, ring: GroupRing, tail: int) -> list[tuple]:
    """Under cp, (segments [b, c], the tail's [b, tail] or None before the sequence) of this
    rank's pieces A and B, from every rank's segments (documents.shards [b, cp, 2c]); (None,
    None) each without document masks."""
    if documents is None:
        return [(None, None), (None, None)]
    shards, rank, last = documents.shards, ring.rank, ring.size - 1
    piece = shards.shape[-1] // 2
    end_a = slice(piece - tail, piece)
    before_a = None if rank == 0 else shards[:, rank - 1, end_a]
    before_b = shards[:, rank, end_a] if rank == last else shards[:, rank + 1, 2 * piece - tail :]
    own_a, own_b = documents.segments.chunk(2, dim=1)
    return [(own_a, before_a), (own_b, before_b)]


class GatedNorm(Norm):
    """RMSNorm over each value head's f, times SiLU of the gate (transformers'
    Qwen3_5RMSNormGated); its weight [f] is replicated, its gradient summed over tp (each rank
    normalizes its own heads)."""

    def __init__(self, dim: int, eps: float, backend: str, tp_split: bool):
        super().__init__(dim, "rmsnorm", eps, backend, tp_split)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * F.silu(gate)


class GatedDeltaNet(nn.Module):
    """The linear attention of plan.index's block."""

    def __init__(self, model: ModelConfig, plan: BlockPlan):
        super().__init__()
        tp = plan.derived.tp
        self.key_dim, self.value_dim = model.linear_key_head_dim, model.linear_value_head_dim
        key_heads, value_heads = model.linear_num_key_heads, model.linear_num_value_heads
        self.local_key_heads, self.local_value_heads = key_heads // tp, value_heads // tp
        self.per_key = value_heads // key_heads
        self.backend, self.tracker = plan.backend, plan.tracker
        self.selective_checkpoint = plan.selective_recompute
        self.ring = plan.ring()
        channels = key_heads * 2 * self.key_dim + value_heads * self.value_dim
        common = dict(
            bias=False,
            sequence_parallel=plan.linear_sequence_parallel,
            tp_group=plan.ps.tp_group,
            init_method=None,
            plan=plan.linear,
        )
        group_rows = (self.key_dim, self.key_dim, self.per_key * self.value_dim)
        self.in_proj_qkv = ColumnParallelLinear(
            model.d_model, channels, out_parts=group_rows, **common
        )
        self.in_proj_z = ColumnParallelLinear(model.d_model, value_heads * self.value_dim, **common)
        self.in_proj_b = ColumnParallelLinear(model.d_model, value_heads, **common)
        self.in_proj_a = ColumnParallelLinear(model.d_model, value_heads, **common)
        width = model.linear_conv_kernel_dim
        self.conv_weight = nn.Parameter(torch.empty(channels // tp, width))
        mark_parallel(self.conv_weight, 0, (channels, width))
        self.A_log = nn.Parameter(torch.empty(value_heads // tp))
        self.dt_bias = nn.Parameter(torch.ones(value_heads // tp))
        for param in (self.A_log, self.dt_bias):
            mark_parallel(param, 0, (value_heads,))
        self.norm = GatedNorm(self.value_dim, model.norm_eps, self.backend, tp > 1)
        self.out_proj = RowParallelLinear(value_heads * self.value_dim, model.d_model, **common)

    def rule_inputs(
        self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The delta rule's q, k [b, k/t, s, e], v [b, v/t, s, f], g and beta [b, v/t, s] from
        the convolution's output mixed [b, s, c/t] (after SiLU) and a, b [b, s, v/t]."""
        batch, seq, _ = mixed.shape
        mixed = mixed.view(batch, seq, self.local_key_heads, -1)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.per_key * self.value_dim], dim=3)
        v = v.reshape(batch, seq, self.local_value_heads, self.value_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [b, s, v/t]
        return tuple(x.transpose(1, 2) for x in (q, k, v, g, b.sigmoid()))

    def mix(self, qkv, a, b, documents: Documents | None) -> torch.Tensor:
        """The convolution, the decay, beta and the delta rule: qkv [b, s, c/t], a and b [b, s,
        v/t] -> o [b, s, v/t, f]; under cp, on each of this rank's zigzag pieces from the
        convolution tail and the state of the piece before it (megatronish.context.state_pass)."""
        if self.ring is not None:
            return self.mix_pieces(qkv, a, b, documents)
        segments = None if documents is None else documents.segments
        conv = causal_conv(qkv.transpose(1, 2), self.conv_weight.to(qkv.dtype), segments)
        inputs = self.rule_inputs(F.silu(conv).transpose(1, 2), a, b)
        return delta_rule(*inputs, self.backend, starts_of(documents))[0].transpose(1, 2)

    def mix_pieces(self, qkv, a, b, documents: Documents | None) -> torch.Tensor:
        """mix under cp: qkv [b, 2c, c/t], a and b [b, 2c, v/t] -> o [b, 2c, v/t, f]."""
        weight = self.conv_weight.to(qkv.dtype)
        tail = weight.shape[1] - 1
        x_a, x_b = qkv.transpose(1, 2).chunk(2, dim=2)  # [b, c/t, c] each
        tails = neighbour_tails(self.ring, x_a, x_b, tail) if tail else (None, None)
        segments = piece_segments(documents, self.ring, tail)
        starts = (None, None) if documents is None else starts_of(documents).chunk(2, dim=1)
        pieces = []
        for x, piece_tail, (own, before), a_, b_ in zip(
            (x_a, x_b), tails, segments, a.chunk(2, dim=1), b.chunk(2, dim=1)
        ):
            conv = causal_conv(x, weight, own, piece_tail, before)
            pieces.append(self.rule_inputs(F.silu(conv).transpose(1, 2), a_, b_))
        dtype = torch.float64 if qkv.dtype == torch.float64 else torch.float32
        zero = qkv.new_zeros(qkv.shape[0], self.local_value_heads, self.key_dim, self.value_dim,
                             dtype=dtype)  # fmt: skip

        def run(piece: int, *inputs):
            return delta_rule(*inputs[:5], self.backend, starts[piece], inputs[5])

        out_a, out_b = zigzag_recurrence(self.ring, run, zero, pieces[0], pieces[1])
        return torch.cat([out_a, out_b], dim=2).transpose(1, 2)

    def projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """qkv [b, s, c/t], z [b, s, v/t f], b and a [b, s, v/t] of x [b, s(/t), h]."""
        layers = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        return shared_input_linears(x, layers)

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [b, s, v/t, f], z [b, s, v/t f] -> out_proj(RMSNorm(o) * SiLU(z)) [b, s(/t), h]."""
        batch, seq = o.shape[:2]
        o = self.norm(o, z.view(batch, seq, self.local_value_heads, self.value_dim))
        return self.out_proj(o.reshape(batch, seq, -1))

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """x [b, s(/t), h] -> [b, s(/t), h]; documents: those of the (whole) sequence."""
        qkv, z, b, a = self.projections(x)
        if self.selective_checkpoint and self.training:
            o = checkpoint(self.mix, self.tracker, qkv, a, b, documents)
        else:
            o = self.mix(qkv, a, b, documents)
        return self.output(o, z)

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Linear attention for incremental decoding: x [b, s, h] after the positions the cache
        holds (None at 0) -> (output [b, s, h], the cache after these positions): the
        convolution's last K - 1 inputs [b, c/t, K - 1] and the state [b, v/t, e, f] (fp32),
        the same size at every position."""
        qkv, z, b, a = self.projections(x)
        width = self.conv_weight.shape[1]
        if cache is None:
            tail, state = qkv.new_zeros(qkv.shape[0], qkv.shape[2], width - 1), None
        else:
            tail, state = cache
        inputs = torch.cat([tail, qkv.transpose(1, 2)], dim=2)  # [b, c/t, K - 1 + s]
        weight = self.conv_weight.to(qkv.dtype).unsqueeze(1)
        conv = F.conv1d(inputs, weight, groups=weight.shape[0])  # [b, c/t, s]
        q, k, v, g, beta = self.rule_inputs(F.silu(conv).transpose(1, 2), a, b)
        o, state = gated_delta_rule(
            q, k, v, g, beta, state, output_final_state=True, l2norm_qk=True, backend=self.backend
        )
        tail = inputs[..., inputs.shape[2] - (width - 1) :]
        return self.output(o.transpose(1, 2), z), (tail, state)
