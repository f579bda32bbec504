"""Each attention head's largest pre-softmax logit over a training step, what QK-clip
(optim.muon.qk_clip_tau, megatronish.optim.qk_clip) bounds: q.k times the softmax scale, after
RoPE and before any soft-cap (the raw product is what grows; a cap only hides it), over the
query-key pairs the masks let through (causal, sliding window, documents; masked pairs never
count). Attention sinks are no query-key logit and do not count.

Where the attention runs on the Triton kernels (ops.attention: no ring, no dropout, no
soft-cap, whose kernels score after the cap) the forward kernel reports each query's largest
score and the heads' maxima are taken from those. Elsewhere torch computes them beside the
attention (only when QK-clip is on): the scores of one sequence at a time, under no_grad.
Under context parallelism a rank's queries meet every cp rank's keys: the keys are
all-gathered over the cp group (counted as all_gather) and masked by the zigzag shards' global
positions and, under document masks, by every shard's segments.

Shapes (legend in megatronish.model): b batch, n query heads, k kv heads (n query heads each
reading kv head i // (n / k)), s this rank's sequence, S the keys' sequence, d head dim.
"""

from __future__ import annotations

import math

import torch

from megatronish import ops
from megatronish.context import Documents, Ring, zigzag_positions
from megatronish.distributed import comm
from megatronish.ops import reference


class LogitMax:
    """The running maximum [n] (fp32) of this rank's heads' logits over the training forward
    passes since take() (every micro-batch of a step; -inf before any)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def record(self, q, k, v, module, documents: Documents | None) -> torch.Tensor | None:
        """Takes in the logits of an attention module's (attention.attend's) q [b, n, s, d] and
        k [b, k, s, d], or, where its forward runs on the Triton kernels, returns the fp32
        [b, n, s] buffer the kernel is to fill (take_rows takes it in after)."""
        plain = module.ring is None and module.dropout == 0 and module.softcap is None
        if plain and ops.attention_backend(module.backend, q, v) == "triton":
            return torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        self.observe(q, k, module.scale, module.window, documents, module.ring)
        return None

    def take_rows(self, rows: torch.Tensor) -> None:
        """Takes in each query's largest logit, rows [b, n, s]."""
        self._merge(rows.amax(dim=(0, 2)))

    @torch.no_grad()
    def observe(self, q, k, scale: float | None, window, documents, ring: Ring | None) -> None:
        """Takes in the logits of q [b, n, s, d] and k [b, k, s, d] (RoPE applied) under the
        causal mask, window (or None) and documents (or None); ring: cp's, or None."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if ring is None:
            segments = None if documents is None else documents.segments
            visible = reference.attention_mask(q.shape[2], q.device, True, segments, window)
        else:
            k, visible = _ring_keys(k, ring, window, documents)
        self._merge(head_logit_max(q, k, scale, visible).float())

    def _merge(self, heads: torch.Tensor) -> None:
        self.value = heads if self.value is None else torch.maximum(self.value, heads)

    def take(self) -> torch.Tensor | None:
        """The maximum so far (None: no training forward ran), started afresh."""
        value, self.value = self.value, None
        return value


def head_logit_max(
    q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor
) -> torch.Tensor:
    """[n]: each head's largest q.k * scale over the batch and the visible pairs (visible bool
    [b or 1, 1, s, S]), in fp32 (fp64 for fp64 inputs); -inf for a head that sees no key."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, n, s, d = q.shape
    kv = k.shape[1]
    best = torch.full((n,), float("-inf"), dtype=dtype, device=q.device)
    for index in range(b):  # one sequence's scores at a time: [k, n / k, s, S]
        qg = q[index].to(dtype).view(kv, n // kv, s, d)
        scores = qg @ k[index].to(dtype).unsqueeze(1).transpose(-1, -2) * scale
        mask = visible[index if visible.shape[0] > 1 else 0]  # [1, s, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(-1, -2)).reshape(n))
    return best


def _ring_keys(k: torch.Tensor, ring: Ring, window, documents: Documents | None):
    """(every cp rank's keys [b, k, cp s, d] in rank order, visible [b or 1, 1, s, cp s]): the
    pairs of this rank's queries and those keys the causal mask (by global positions), the
    window and the documents let through."""
    b, kv, s, d = k.shape
    gathered = k.new_empty(ring.size * s, b, kv, d)
    comm.all_gather_into(gathered, k.permute(2, 0, 1, 3).contiguous(), ring.group)
    keys = gathered.permute(1, 2, 0, 3)
    queries = zigzag_positions(s, ring.size, ring.rank, k.device)
    positions = [zigzag_positions(s, ring.size, rank, k.device) for rank in range(ring.size)]
    distance = queries[:, None] - torch.cat(positions)[None, :]  # [s, cp s]
    visible = distance >= 0
    if window is not None:
        visible = visible & (distance < window)
    visible = visible[None, None]
    if documents is not None:
        shards = documents.shards  # [b, cp, s]
        same = shards[:, ring.rank, :, None] == shards.reshape(b, -1)[:, None, :]
        visible = visible & same[:, None]
    return keys, visible
