"""Multi-head latent attention (DeepSeek-V2/V3, model.attention mla), as transformers'
DeepseekV3Attention computes it:

  queries   x -> q_a (down to q_lora_rank) -> RMSNorm -> q_b (up to n heads of nope + rope),
            or one projection q when q_lora_rank is null;
  latent    x -> kv_a (down to kv_lora_rank + rope) -> the latent part's RMSNorm, and the rope
            part: one rotary key shared by every head (decoupled RoPE);
  keys      [kv_b(latent) nope part, the shared rotary key], values kv_b(latent)'s v part;
  attention over the query-key dim nope + rope with the values' v dim, then proj (n x v to h).

RoPE pairs the rotary dims interleaved, (0, 1), (2, 3), ... (transformers' rope_interleave, as
the published weights are laid out): the rotary parts are de-interleaved (even dims, then odd
dims) and rotated with rotate-half pairing, which gives the same scores. The softmax scale is
1 / sqrt(nope + rope), times YaRN's mscale(factor, mscale_all_dim)^2 when rope scaling is YaRN
with mscale_all_dim set (applied by scaling the queries).

Tensor parallelism: the heads split over tp (q or q_b and kv_b column-parallel, proj
row-parallel); the down-projections q_a and kv_a and their norms are replicated and run on this
rank's tokens (the sequence shard under sequence parallelism, whose gradients are then summed
over tp); their outputs enter the tensor-parallel region together, one all-gather along the
sequence under sequence parallelism. Context parallelism: the ring carries the keys (nope +
rope) and the values (v).

Shapes (legend in megatronish.model): b batch, s sequence (this rank's cp shard; s / t of it
before the latents enter the tp region under sequence parallelism), h d_model, n query heads,
t tp size, r kv_lora_rank, p qk_rope_head_dim, e qk_nope_head_dim, v v_head_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatronish import ops
from megatronish.config import ModelConfig, attention_window
from megatronish.config.mla_shapes import mla_shapes
from megatronish.context import Documents
from megatronish.layers import mappings
from megatronish.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_parallel,
    to_autocast_dtype,
)
from megatronish.layers.roles import set_role
from megatronish.model.attention import attend, decode_mask, rope_positions
from megatronish.model.logit_max import LogitMax
from megatronish.model.norm import Norm
from megatronish.model.plan import BlockPlan
from megatronish.model.recompute import checkpoint
from megatronish.ops import reference
from megatronish.ops.rope import RopeSpec, YarnScaling, rope_spec, yarn_mscale


def softmax_scale_factor(spec: RopeSpec) -> float:
    """The factor on 1 / sqrt(query-key head dim) of the softmax scale: YaRN's
    mscale(factor, mscale_all_dim)^2 with mscale_all_dim set, else 1 (DeepSeek-V3)."""
    scaling = spec.scaling
    if isinstance(scaling, YarnScaling) and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return 1.0


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x [..., p] with its rotary pairs interleaved (0, 1), (2, 3), ... as [even dims, odd
    dims]: the rotate-half layout (dim i pairs with dim i + p/2)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class ReplicatedLinear(nn.Module):
    """x W^T with W [out, in] whole on every tp rank (init: model.init); under sequence
    parallelism each rank's gradient covers its tokens only and is summed over tp."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        mark_parallel(self.weight, None, (out_features, in_features))
        set_role(self.weight, sequence_parallel_grad=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LatentAttention(nn.Module):
    """The multi-head latent attention of plan.index's block (the index picks its sliding
    window)."""

    def __init__(self, model: ModelConfig, plan: BlockPlan):
        super().__init__()
        mla, tp = model.mla, plan.derived.tp
        self.local_heads = model.n_head // tp
        self.nope, self.rope_dim, self.v_dim = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        )
        self.kv_rank, self.q_rank = mla.kv_lora_rank, mla.q_lora_rank
        self.rope = rope_spec(model)
        self.q_factor = softmax_scale_factor(self.rope)
        self.dropout, self.tracker, self.backend = model.dropout, plan.tracker, plan.backend
        self.selective_checkpoint = plan.selective_recompute
        self.cp, self.ring = plan.derived.cp, plan.ring()
        self.window = attention_window(model, plan.index)
        self.scale = self.softcap = self.sinks = None  # the plain scores (attention.attend)
        self.logit_max = LogitMax() if plan.logit_max else None  # QK-clip's record
        self.group = plan.ps.tp_group
        self.sequence_parallel = sp = plan.sequence_parallel
        shapes = mla_shapes(model)
        norm = (model.norm_eps, self.backend, sp)
        common = dict(bias=False, tp_group=self.group, init_method=None, plan=plan.linear)
        if self.q_rank is None:
            self.q = ColumnParallelLinear(
                model.d_model, shapes.q_out, sequence_parallel=sp, **common
            )
        else:
            self.q_a = ReplicatedLinear(model.d_model, self.q_rank, sp)
            self.q_a_norm = Norm(self.q_rank, "rmsnorm", *norm)
            self.q_b = ColumnParallelLinear(self.q_rank, shapes.q_out, **common)
        self.kv_a = ReplicatedLinear(model.d_model, shapes.latent, sp)
        self.kv_a_norm = Norm(self.kv_rank, "rmsnorm", *norm)
        self.kv_b = ColumnParallelLinear(self.kv_rank, shapes.kv_b_out, **common)
        self.proj = RowParallelLinear(
            shapes.proj_in,
            model.d_model,
            bias=False,
            sequence_parallel=sp,
            tp_group=self.group,
            init_method=None,
            plan=plan.linear,
        )

    def _to_tp_region(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated activations [b, s(/t), .] into the tensor-parallel region: all-gathered
        along the sequence under sequence parallelism, else copied (backward sums over tp)."""
        x = to_autocast_dtype(x)
        return mappings.to_tensor_parallel_region(x, self.group, self.sequence_parallel)

    def latents(self, x: torch.Tensor):
        """x [b, s(/t), h] -> (q [b, s, n/t, e + p], the normed kv latent [b, s, r], the shared
        rotary key [b, s, p] before RoPE, de-interleaved)."""
        kv = self.kv_a(x)  # [b, s(/t), r + p]
        latent, k_rope = kv.split([self.kv_rank, self.rope_dim], dim=-1)
        parts = [self.kv_a_norm(latent), k_rope]
        if self.q_rank is not None:
            parts.insert(0, self.q_a_norm(self.q_a(x)))  # [b, s(/t), q_lora_rank]
        gathered = self._to_tp_region(torch.cat(parts, dim=-1))  # one collective
        if self.q_rank is None:
            latent, k_rope = gathered.split([self.kv_rank, self.rope_dim], dim=-1)
            q = self.q(x)
        else:
            q_latent, latent, k_rope = gathered.split(
                [self.q_rank, self.kv_rank, self.rope_dim], dim=-1
            )
            q = self.q_b.local(q_latent)
        b, s = q.shape[:2]
        return q.view(b, s, self.local_heads, -1), latent, deinterleave(k_rope)

    def heads(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor):
        """q [b, s, n/t, e + p] and the latent [b, S, r] with the rotated shared rotary key
        [b, S, p] -> (q nope [b, n/t, s, e], q rope [b, n/t, s, p] de-interleaved, keys
        [b, n/t, S, e + p], values [b, n/t, S, v]) for these heads."""
        q_nope, q_rope = q.transpose(1, 2).split([self.nope, self.rope_dim], dim=-1)
        b, length = latent.shape[:2]
        kv = self.kv_b.local(latent).view(b, length, self.local_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1).expand(-1, self.local_heads, -1, -1)
        return q_nope, deinterleave(q_rope), torch.cat([k_nope, k_rope], dim=-1), v

    def _query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[q nope, rotated q rope], times the softmax scale's factor (the kernels scale by
        1 / sqrt(e + p))."""
        q = torch.cat([q_nope, q_rope], dim=-1)
        return q * self.q_factor if self.q_factor != 1.0 else q

    def core(self, q, latent, k_rope, documents: Documents | None) -> torch.Tensor:
        """q [b, s, n/t, e + p], latent [b, s, r], k_rope [b, s, p] (full sequence of this cp
        shard) -> [b, n/t, s, v]."""
        positions, segments = rope_positions(documents, self.ring, self.cp, q.shape[1], q.device)
        k_rope = ops.rope(k_rope.unsqueeze(1), self.rope, self.backend, positions).squeeze(1)
        q_nope, q_rope, k, v = self.heads(q, latent, k_rope)
        q_rope = ops.rope(q_rope, self.rope, backend=self.backend, positions=positions)
        q = self._query(q_nope, q_rope)
        return attend(self, q, k, v, documents, segments)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """x [b, s(/t), h] -> [b, s(/t), h]; documents: this rank's tokens' under document
        masks."""
        q, latent, k_rope = self.latents(x)
        b, s = q.shape[:2]
        if self.selective_checkpoint and self.training:
            y = checkpoint(self.core, self.tracker, q, latent, k_rope, documents)
        else:
            y = self.core(q, latent, k_rope, documents)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.v_dim))

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention for incremental decoding: x [b, s, h] at positions start_pos.., cache the
        (normed latent [b, start_pos, r], rotated shared rotary key [b, start_pos, p]) of the
        earlier positions (None at 0) -> (output [b, s, h], the cache extended by these
        positions). The keys and values are rebuilt from the cached latent by kv_b."""
        q, latent, k_rope = self.latents(x)
        b, s = q.shape[:2]
        k_rope = reference.rope(k_rope.unsqueeze(1), self.rope, start_pos).squeeze(1)
        if cache is not None:
            latent = torch.cat([cache[0], latent], dim=1)
            k_rope = torch.cat([cache[1], k_rope], dim=1)
        q_nope, q_rope, k, v = self.heads(q, latent, k_rope)
        q = self._query(q_nope, reference.rope(q_rope, self.rope, start_pos))
        visible = decode_mask(start_pos, s, k.shape[2], self.window, x.device)
        scale = 1.0 / math.sqrt(q.shape[-1])
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.v_dim)
        return self.proj(y), (latent, k_rope)
