"""Ring attention over the zigzag split (megatronish.context.zigzag).

Shapes: b batch, n query heads (this tp rank's), k kv heads (this tp rank's), c chunk length,
d query-key head dim, e value head dim (e may differ from d: multi-head latent attention).
Local q [b, n, 2c, d], k [b, k, 2c, d] and v [b, k, 2c, e] hold this cp rank's chunks r and
2 cp - 1 - r. Only the kv heads travel (grouped-query attention sends k, not n, heads), keys
and values as one message a hop (a flat buffer of both).

Forward: the keys and values go around the cp ring, cp - 1 hops; the send of the block held
now to the next rank and the receive of the next block from the previous one are posted
before the held block is computed, so the transfer overlaps the compute. At ring step i a rank
holds the block of rank r - i (mod cp); every step is half a block of work, no offset mask:
  i = 0:      local q against local k/v, causal (the local order is increasing positions);
  0 < i <= r: all local q against the source's first chunk (earlier positions), unmasked;
  i > r:      the second half of q against all of the source's k/v (both earlier), unmasked.
Steps run as square c x c (or, at i = 0, 2c x 2c causal) blocks; partial outputs are merged in
fp32 with their log-sum-exp: lse = logaddexp(lse_old, lse_b) and
o = o e^(lse_old - lse) + o_b e^(lse_b - lse).

Sliding window (model.sliding_window W): a query at global position i sees the keys at j with
i - j < W. Each block knows its chunks' global positions: the window masks it by the distance
of its first query from its first key (offset), so step 0 runs as three blocks (chunk r
causal, chunk 2 cp - 1 - r causal, then the second chunk against the first), and a block whose
every pair is W or more apart is not computed at all (its keys and values still travel on).
With W below 2 c (s / cp) most blocks away from the diagonal are skipped.

Document masks: every rank holds the segments of every cp rank's shard (shards [b, cp, 2c],
megatronish.context.documents), so none travel: each block masks the pairs of different
documents with the local queries' and the source rank's keys' segments, and the Triton blocks
skip the key blocks of other documents (a whole block, when all its keys precede the queries'
documents). A document may span chunks, cp ranks and ring steps.

Scores: a softmax scale (None: 1/sqrt(d)) and a soft-cap c (the scores become c tanh(s / c))
apply within every block. Attention sinks (a logit per query head in every softmax's
denominator, with no value) join each query's merged lse once, after the last block:
lse' = logaddexp(lse, sink), o = o e^(lse - lse'); they do not travel (they are every rank's).

Backward: the keys and values go around again, and with them an fp32 accumulator of dk, dv
that belongs to the block's owner: each rank adds its blocks' dk, dv (flash backward from the
final output and log-sum-exp, so rowsum(do * o) uses the global o) and passes it on; after cp
hops it is back with its owner. dq accumulates locally in fp32. The blocks' backward reads
the final lse, which holds the sinks; a sink's gradient is -sum over the rows of
e^(sink - lse') rowsum(do * o), over this rank's rows (summed over cp with the other
replicated parameters' gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatronish.context.blocks import accumulation_dtype, block_ops
from megatronish.context.zigzag import chunks_of
from megatronish.distributed.layout import ParallelState
from megatronish.distributed.ring import GroupRing

KV_TAG, DKV_TAG = 11, 12

_COUNTERS: list[RingCounter] = []


@dataclass
class RingCounter:
    """Attention work of the ring blocks run while active (``with RingCounter() as c:``):
    query-key pairs scored (a causal block of L counts L (L + 1) / 2 per head; under a sliding
    window the pairs within it) and forward FLOPs (2 (d + e) per pair: q k^T and p v)."""

    pairs: int = 0
    flops: int = 0
    blocks: list = field(default_factory=list)

    def __enter__(self) -> RingCounter:
        _COUNTERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _COUNTERS.remove(self)


def visible_pairs(length: int, causal: bool, window: int | None, offset: int) -> int:
    """Query-key pairs one head of a length x length block scores: all, the causal triangle,
    and under a sliding window only those (i + offset) - j < window apart (offset: the first
    query's position less the first key's)."""
    rows = torch.arange(length)
    last = rows if causal else torch.full_like(rows, length - 1)  # each row's last key
    first = torch.zeros_like(rows) if window is None else (rows + offset - window + 1).clamp(0)
    return int((last - first + 1).clamp(min=0).sum())


def _count(q: torch.Tensor, causal: bool, pairs_per_head: int, v_dim: int) -> None:
    b, n, length, d = q.shape
    pairs = b * n * pairs_per_head
    for counter in _COUNTERS:
        counter.pairs += pairs
        counter.flops += 2 * (d + v_dim) * pairs
        counter.blocks.append((length, causal))


class Ring(GroupRing):
    """This rank's place in its cp group's ring (ring attention; shifts counted as "cp_ring")."""

    @classmethod
    def of(cls, ps: ParallelState) -> Ring:
        """This rank's ring attention ring: its cp group, in cp rank order."""
        return cls.of_group(ps.cp_group, "cp_ring")


def _units(step: int, rank: int, windowed: bool) -> list[tuple[str, str, bool]]:
    """(query part, key/value part, causal) blocks of ring step `step` on cp rank `rank`; step 0
    under a sliding window as three blocks of contiguous positions, the causal ones first
    (every row sees a key there)."""
    if step == 0 and windowed:
        return [("first", "first", True), ("second", "second", True), ("second", "first", False)]
    if step == 0:
        return [("all", "all", True)]
    if step <= rank:
        return [("first", "first", False), ("second", "first", False)]
    return [("second", "first", False), ("second", "second", False)]


def _offset(ring: Ring, step: int, q_part: str, kv_part: str, c: int) -> int:
    """The global position of a block's first query less that of its first key: the block's
    query chunk and the key chunk of the rank its keys came from (zigzag.chunks_of)."""
    source = (ring.rank - step) % ring.size
    q_chunk = chunks_of(ring.size, ring.rank)[q_part == "second"]
    k_chunk = chunks_of(ring.size, source)[kv_part == "second"]
    return (q_chunk - k_chunk) * c


def _blocks(ring: Ring, step: int, c: int, window: int | None):
    """(query part, key/value part, causal, offset, pairs per head) of the blocks ring step
    `step` computes: those with a pair inside the window."""
    blocks = []
    for q_part, kv_part, causal in _units(step, ring.rank, window is not None):
        offset = _offset(ring, step, q_part, kv_part, c)
        length = 2 * c if q_part == "all" else c
        pairs = visible_pairs(length, causal, window, offset)
        if pairs:
            blocks.append((q_part, kv_part, causal, offset, pairs))
    return blocks


def _part(x: torch.Tensor, part: str, c: int) -> torch.Tensor:
    """The rows of x [.., 2c, ..] (sequence on dim 2) that `part` names."""
    if part == "all":
        return x
    return x[:, :, :c] if part == "first" else x[:, :, c:]


def _segments(shards, step: int, ring: Ring, q_part: str, kv_part: str, c: int):
    """(queries', keys') segments [b, L] of a block at ring step `step`, or None (no masks):
    the keys are those of the rank the held block came from."""
    if shards is None:
        return None
    source = (ring.rank - step) % ring.size
    q_seg, k_seg = shards[:, ring.rank], shards[:, source]
    return q_seg[:, _rows(q_part, c)], k_seg[:, _rows(kv_part, c)]


def _rows(part: str, c: int) -> slice:
    return {"all": slice(None), "first": slice(0, c), "second": slice(c, 2 * c)}[part]


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k and v in one flat buffer (one message a hop, whatever their head dims)."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The keys and values of a buffer packed like k and v (views of it)."""
    split = k.numel()
    return kv[:split].view(k.shape), kv[split:].view(v.shape)


def _merge(out, lse, rows: slice, out_b, lse_b) -> None:
    """Merges a block's partial (out_b, lse_b) into rows of the running out, lse in place."""
    lse_old = lse[:, :, rows]
    lse_new = torch.logaddexp(lse_old, lse_b)
    out[:, :, rows] = out[:, :, rows] * torch.exp(lse_old - lse_new).unsqueeze(-1) + out_b.to(
        out.dtype
    ) * torch.exp(lse_b - lse_new).unsqueeze(-1)
    lse[:, :, rows] = lse_new


def _join_sinks(out, lse, sinks: torch.Tensor):
    """(out, lse) with the sinks [n] joined to every row's denominator (no value)."""
    lse_new = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - lse_new).unsqueeze(-1), lse_new


def _sink_grad(sinks: torch.Tensor, out, lse, dout) -> torch.Tensor:
    """d loss / d sinks [n] in the sinks' dtype from the final out and lse of this rank's
    rows: each row's sink probability times (0 - rowsum(dout * out))."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


def ring_forward(
    q, k, v, ring: Ring, forward, shards=None, window: int | None = None, **scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) in the accumulation dtype for local q, k, v; `forward` is a block forward;
    shards: every cp rank's segments [b, cp, 2c] under document masks, else None; window: the
    sliding window, or None; scores: the blocks' scale and softcap (None: none), as keywords."""
    c = q.shape[2] // 2
    dtype = accumulation_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=dtype)  # merged into: o 0, lse -inf
    lse = torch.full(q.shape[:3], float("-inf"), dtype=dtype, device=q.device)
    kv = _pack(k, v)
    for step in range(ring.size):
        pending = None
        if step + 1 < ring.size:
            incoming, pending = ring.shift(kv, KV_TAG)
        for q_part, kv_part, causal, offset, pairs in _blocks(ring, step, c, window):
            q_block = _part(q, q_part, c)
            _count(q_block, causal, pairs, v.shape[-1])
            segments = _segments(shards, step, ring, q_part, kv_part, c)
            keys, values = (_part(x, kv_part, c) for x in _unpack(kv, k, v))
            out_b, lse_b = forward(
                q_block, keys, values, causal, segments, window, offset, **scores
            )
            _merge(out, lse, _rows(q_part, c), out_b, lse_b.to(dtype))
        if pending is not None:
            pending.wait()
            kv = incoming
    return out, lse


def ring_backward(
    q, k, v, out, lse, dout, ring: Ring, backward, shards=None, window=None, **scores
):
    """(dq, dk, dv) in the inputs' dtypes; `backward` is a block backward; shards, window and
    scores as in ring_forward (lse: the final one, sinks joined)."""
    c = q.shape[2] // 2
    dtype = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    kv = _pack(k, v)
    dkv = dkv_pending = None
    for step in range(ring.size):
        pending = None
        if step + 1 < ring.size:
            incoming, pending = ring.shift(kv, KV_TAG)
        grads = []
        for q_part, kv_part, causal, offset, _ in _blocks(ring, step, c, window):
            rows = _rows(q_part, c)
            keys, values = _unpack(kv, k, v)
            dq_b, dk_b, dv_b = backward(
                _part(q, q_part, c),
                _part(keys, kv_part, c),
                _part(values, kv_part, c),
                out[:, :, rows],
                lse[:, :, rows],
                dout[:, :, rows],
                causal,
                _segments(shards, step, ring, q_part, kv_part, c),
                window,
                offset,
                **scores,
            )
            dq[:, :, rows] += dq_b
            grads.append((_rows(kv_part, c), dk_b, dv_b))
        if dkv_pending is None:  # step 0: this rank's own block
            dkv = torch.zeros(kv.shape, dtype=dtype, device=q.device)
        else:
            dkv_pending[1].wait()
            dkv = dkv_pending[0]
        dk, dv = _unpack(dkv, k, v)
        for rows, dk_b, dv_b in grads:
            dk[:, :, rows] += dk_b
            dv[:, :, rows] += dv_b
        if ring.size > 1:  # on to the rank whose block comes next; the last hop reaches the owner
            dkv_pending = ring.shift(dkv, DKV_TAG)
        if pending is not None:
            pending.wait()
            kv = incoming
    if dkv_pending is not None:
        dkv_pending[1].wait()
        dkv = dkv_pending[0]
    dk, dv = _unpack(dkv, k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Autocast is off inside: the blocks choose their own precision (fp32 accumulation)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, backend: str, shards, window, scale, sinks, softcap):
        forward, backward = block_ops(backend)
        scores = dict(scale=scale, softcap=softcap)
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_forward(q, k, v, ring, forward, shards, window, **scores)
            if sinks is not None:
                out, lse = _join_sinks(out, lse, sinks.detach())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.block_backward, ctx.shards, ctx.window = ring, backward, shards, window
        ctx.scores = scores
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        args = (ctx.ring, ctx.block_backward, ctx.shards, ctx.window)
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = ring_backward(q, k, v, out, lse, dout, *args, **ctx.scores)
            dsinks = None if sinks is None else _sink_grad(sinks, out, lse, dout)
        return dq, dk, dv, None, None, None, None, None, dsinks, None


def ring_attention(
    q,
    k,
    v,
    ring: Ring,
    backend: str = "auto",
    shards: torch.Tensor | None = None,
    window: int | None = None,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the full sequence, computed on this cp rank's zigzag shard:
    q [b, n, 2c, d], k [b, k, 2c, d] and v [b, k, 2c, e] -> [b, n, 2c, e] in q's dtype; the keys
    and values
    of the other cp ranks' shards come around the ring. Every cp rank calls it together. Under
    document masks, shards [b, cp, 2c] holds the segments of every cp rank's shard; under a
    sliding window W (None: none) a query sees only the keys less than W positions before it,
    itself included, by global position. scale (None: 1/sqrt(d)), softcap and sinks [n] as
    ops.attention takes them."""
    from megatronish.ops import attention_backend

    if q.shape[2] % 2:
        raise ValueError(f"ring attention: local sequence {q.shape[2]} must be two equal chunks")
    if window is not None and window >= q.shape[2] * ring.size:  # it leaves out no pair
        window = None
    backend = attention_backend(backend, q, v)
    return _RingAttention.apply(q, k, v, ring, backend, shards, window, scale, sinks, softcap)
