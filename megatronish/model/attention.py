"""Parallel attention: qkv column-parallel (heads split over tp), core attention (flash
kernel, torch SDPA, or ring attention over cp; under the block's sliding window, if any),
output row-parallel; and the cached forward of incremental decoding. RoPE rotates each head's
first rotary dims (all of them unless model.partial_rotary_factor < 1); with the components'
attention_gate the qkv projection also gives a gate per query head (beside its query), and the
output is multiplied by sigmoid(gate) before the output projection (Qwen3.5).

Shapes (legend in megatronish.model): b batch, s sequence (this rank's cp shard), h d_model,
n query heads, k kv heads, d head dim, t tp size.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megatronish import ops
from megatronish.config import ModelConfig, attention_window
from megatronish.context import Documents, Ring, ring_attention, zigzag_positions
from megatronish.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_parallel,
)
from megatronish.model.adapters import column_adapters, row_adapter
from megatronish.model.logit_max import LogitMax
from megatronish.model.norm import Norm
from megatronish.model.plan import BlockPlan
from megatronish.model.recompute import checkpoint
from megatronish.ops import reference
from megatronish.ops.rope import rope_spec


def rope_positions(
    documents: Documents | None, ring: Ring | None, cp: int, s: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the positions RoPE rotates these s tokens by, their documents' segments): the positions
    within each document under document masks, a cp rank's zigzag shard's global positions,
    or None (0..s-1) for both."""
    if documents is not None:
        return documents.positions, documents.segments
    if ring is not None:
        return zigzag_positions(s, cp, ring.rank, device), None
    return None, None


def attend(module, q, k, v, documents: Documents | None, segments) -> torch.Tensor:
    """The attention core after RoPE of an attention module (its ring, backend, window, dropout
    and RNG tracker, and its score options: scale, sinks, softcap, None where it has none):
    q [b, n/t, s, d], k [b, k/t, s, d], v [b, k/t, s, d_v] -> [b, n/t, s, d_v]; ring attention
    over cp, SDPA with dropout on a per-rank stream, or ops.attention. In training, the
    module's logit_max (if any) takes in the logits."""
    options = score_options(module)
    rows = None  # QK-clip's record: the kernel's buffer, or taken in already
    if module.logit_max is not None and module.training:
        rows = module.logit_max.record(q, k, v, module, documents)
    if module.ring is not None:
        shards = None if documents is None else documents.shards
        return ring_attention(
            q, k, v, module.ring, module.backend, shards, module.window, **options
        )
    if module.dropout > 0 and module.training:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = None
        explicit = options["sinks"] is not None or options["softcap"] is not None
        if segments is not None or module.window is not None or explicit:
            mask = reference.attention_mask(q.shape[2], q.device, True, segments, module.window)
        with module.tracker.fork():  # heads differ per tp rank: a per-rank stream
            if explicit:  # SDPA has neither sinks nor soft-capping
                scale = options["scale"] or 1.0 / math.sqrt(q.shape[-1])
                return reference.explicit_attention(
                    q, k, v, mask, scale, options["sinks"], options["softcap"], module.dropout
                )
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=module.dropout,
                is_causal=mask is None,
                scale=options["scale"],
            )
    out = ops.attention(
        q, k, v, True, module.backend, segments, module.window, **options, row_max=rows
    )
    if rows is not None:
        module.logit_max.take_rows(rows)
    return out


def score_options(module) -> dict:
    """An attention module's options on its scores, as ops.attention takes them: scale (None:
    1/sqrt(d)), sinks (this rank's heads' sink logits, or None) and softcap (or None)."""
    return {"scale": module.scale, "sinks": module.sinks, "softcap": module.softcap}


def decode_mask(start_pos: int, s: int, keys: int, window: int | None, device) -> torch.Tensor:
    """[s, keys] bool: which of the cached and new keys (positions 0..keys-1) the queries at
    start_pos.. see in incremental decoding (causal, within the sliding window if any)."""
    positions = torch.arange(start_pos, start_pos + s, device=device)[:, None]
    key_positions = torch.arange(keys, device=device)[None, :]
    visible = key_positions <= positions
    if window is not None:
        visible = visible & (positions - key_positions < window)
    return visible


def rotate_leading(x: torch.Tensor, dims: int, rotate) -> torch.Tensor:
    """x [..., d] with `rotate` applied to its first `dims` of d (the rest pass as they are)."""
    if dims == x.shape[-1]:
        return rotate(x)
    return torch.cat([rotate(x[..., :dims].contiguous()), x[..., dims:]], dim=-1)


class Attention(nn.Module):
    """The attention of plan.index's block (the index picks its sliding window)."""

    def __init__(self, model: ModelConfig, plan: BlockPlan):
        super().__init__()
        derived, tp = plan.derived, plan.derived.tp
        self.head_dim = derived.head_dim
        self.local_heads, self.local_groups = model.n_head // tp, derived.n_kv_head // tp
        self.heads_per_group = model.n_head // derived.n_kv_head
        self.window = attention_window(model, plan.index)  # None: every earlier position
        self.rotary = plan.components.rope
        self.rope = rope_spec(model, sliding=self.window is not None)
        self.rotary_dims = int(self.head_dim * model.partial_rotary_factor)
        self.gated = plan.components.attention_gate
        gates = self.heads_per_group if self.gated else 0  # gate heads per kv group
        self.dropout, self.tracker = model.dropout, plan.tracker
        self.backend = plan.backend
        self.selective_checkpoint = plan.selective_recompute
        self.cp, self.ring = derived.cp, plan.ring()
        scalar, self.softcap = model.query_pre_attn_scalar, model.attn_logit_softcapping
        self.scale = None if scalar is None else scalar**-0.5  # None: 1/sqrt(d)
        self.logit_max = LogitMax() if plan.logit_max else None  # QK-clip's record
        self.register_parameter("sinks", None)  # this rank's heads' sink logits
        if plan.components.attention_sinks:  # normal(0, 0.02) as every matrix, as transformers
            self.sinks = nn.Parameter(torch.empty(self.local_heads))
            mark_parallel(self.sinks, 0, (model.n_head,))
        sp, group = plan.linear_sequence_parallel, plan.ps.tp_group
        qkv_out = (model.n_head + gates * derived.n_kv_head + 2 * derived.n_kv_head) * self.head_dim
        query = self.heads_per_group * self.head_dim
        parts = (query, query) if self.gated else (query,)
        # the adapters' logical parts per kv group (a gated query's gates get none)
        named = {"q_proj": query} | ({"q_gate": query} if self.gated else {})
        named |= {"k_proj": self.head_dim, "v_proj": self.head_dim}
        self.qkv = ColumnParallelLinear(
            model.d_model,
            qkv_out,
            bias=plan.components.qkv_bias,
            sequence_parallel=sp,
            tp_group=group,
            init_method=None,
            plan=plan.linear,
            # per key-value group: its query heads, (their gates,) its key head, its value head
            out_parts=(*parts, self.head_dim, self.head_dim),
            lora=column_adapters(model, plan, model.d_model, named, derived.n_kv_head),
        )
        self.q_norm = self.k_norm = None
        if model.qk_norm:  # each rank normalizes its own heads: its gradient is summed over tp
            offset = plan.components.norm_offset
            norm = (self.head_dim, "rmsnorm", model.norm_eps, self.backend, tp > 1, offset)
            self.q_norm, self.k_norm = Norm(*norm), Norm(*norm)
        self.proj = RowParallelLinear(
            model.n_head * self.head_dim,
            model.d_model,
            bias=plan.components.linear_bias,
            sequence_parallel=sp,
            tp_group=group,
            init_method=None,
            plan=plan.linear,
            lora=row_adapter(model, plan, "o_proj", model.n_head * self.head_dim, model.d_model),
        )

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None
    ) -> torch.Tensor:
        """q [b, n/t, s, d], k and v [b, k/t, s, d] -> [b, n/t, s, d]; under document masks
        (documents of these s tokens) attention stays within each document and RoPE rotates
        by the positions within it."""
        positions, segments = rope_positions(documents, self.ring, self.cp, q.shape[2], q.device)
        if self.rotary:
            rotate = partial(ops.rope, theta=self.rope, backend=self.backend, positions=positions)
            q = rotate_leading(q, self.rotary_dims, rotate)
            k = rotate_leading(k, self.rotary_dims, rotate)
        return attend(self, q, k, v, documents, segments)

    def split_heads(self, x: torch.Tensor):
        """x [b, s, h] -> q [b, n/t, s, d], k and v [b, k/t, s, d] of this rank's heads, and
        their gates [b, s, n/t * d] (None without attention_gate)."""
        qkv = self.qkv(x)  # [b, s, (n (+ n) + 2k) / t * d]
        b, s, _ = qkv.shape
        group = self.heads_per_group
        gates = group if self.gated else 0
        qkv = qkv.view(b, s, self.local_groups, group + gates + 2, self.head_dim)
        # One split (its backward is one concatenation, not a zero-filled buffer per slice);
        # q is a view when each group has one query head (gpt2), a copy otherwise.
        q, gate, k, v = qkv.split([group, gates, 1, 1], dim=3)
        q, k = q.reshape(b, s, self.local_heads, self.head_dim), k.squeeze(3)
        if self.q_norm is not None:  # RMSNorm of each head over d, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        gate = gate.reshape(b, s, self.local_heads * self.head_dim) if self.gated else None
        return q.transpose(1, 2), k.transpose(1, 2), v.squeeze(3).transpose(1, 2), gate

    def output(self, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention core's y [b, n/t, s, d] -> [b, s, h]: its heads, times sigmoid(gate)
        under attention_gate, through the output projection."""
        b, s = y.shape[0], y.shape[2]
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, n/t * d]
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.proj(y)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; documents: this rank's tokens' under document masks."""
        q, k, v, gate = self.split_heads(x)
        if self.selective_checkpoint and self.training:
            y = checkpoint(self.core, self.tracker, q, k, v, documents)
        else:
            y = self.core(q, k, v, documents)
        return self.output(y, gate)

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention for incremental decoding: x [b, s, h] at positions start_pos.., cache the
        (k, v) [b, k/t, start_pos, d] of the earlier positions (None at 0) -> (output [b, s, h],
        the cache extended by these positions). RoPE rotates by the absolute positions; the
        cache keeps every position, and the sliding window masks those out of reach."""
        q, k, v, gate = self.split_heads(x)
        s = q.shape[2]
        if self.rotary:
            rotate = partial(reference.rope, spec=self.rope, start_pos=start_pos)
            q = rotate_leading(q, self.rotary_dims, rotate)
            k = rotate_leading(k, self.rotary_dims, rotate)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        keys, values = k, v  # [b, k/t, start_pos + s, d]
        if self.heads_per_group > 1:
            keys = k.repeat_interleave(self.heads_per_group, dim=1)
            values = v.repeat_interleave(self.heads_per_group, dim=1)
        visible = decode_mask(start_pos, s, keys.shape[2], self.window, x.device)
        options = score_options(self)
        scale = options["scale"] or 1.0 / math.sqrt(self.head_dim)
        if options["sinks"] is None and options["softcap"] is None:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
        else:
            y = reference.explicit_attention(
                q, keys, values, visible, scale, options["sinks"], options["softcap"]
            )
        return self.output(y, gate), (k, v)
