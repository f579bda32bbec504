"""GPT-2 and Llama, written tensor-parallel from the start.

Shapes: b batch, s sequence (s / t inside blocks with sequence parallelism), h d_model,
n query heads, k kv heads, d head dim, f d_ff, V padded vocab, t tp size. With context
parallelism (cp > 1) s is this rank's zigzag shard of the sequence, seq_len / cp tokens at
their global positions (megatronish.context), and attention is ring attention over the cp group.
Attention: qkv column-parallel [h -> (n + 2k) d], heads split over tp; output row-parallel.
MLP: column-parallel up (and gate for llama), row-parallel down. Logits come out split over
the vocab, [b, s, V / t], and go straight into the vocab-parallel loss.

The fused qkv weight is laid out by kv group: for each of the k groups, its n/k query heads,
then its key head, then its value head. Contiguous blocks of it are whole groups, so every tp
rank gets the heads it needs and the full weight is the same at every tp.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megatronish import ops
from megatronish.config import Config, Derived
from megatronish.context import Ring, ring_attention, zigzag_positions
from megatronish.distributed import comm
from megatronish.distributed.layout import ParallelState, RNGTracker
from megatronish.layers import mappings
from megatronish.layers.embedding import VocabParallelEmbedding
from megatronish.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel_linear,
    mark_parallel,
    to_autocast_dtype,
)
from megatronish.moe import MoELayer
from megatronish.moe.experts import stored_tensors
from megatronish.moe.layer import recomputing
from megatronish.observe.profile import annotate
from megatronish.ops import reference


class Norm(nn.Module):
    """LayerNorm (gpt2) or RMSNorm (llama) over h; its parameters are replicated on tp ranks."""

    def __init__(self, dim: int, kind: str, eps: float, backend: str, sequence_parallel: bool):
        super().__init__()
        self.kind, self.eps, self.backend = kind, eps, backend
        self.weight = nn.Parameter(torch.ones(dim))
        mark_parallel(self.weight, None, (dim,))
        self.weight.sequence_parallel_grad = sequence_parallel
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.zeros(dim))
            mark_parallel(self.bias, None, (dim,))
            self.bias.sequence_parallel_grad = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return ops.layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)
        return ops.rms_norm(x, self.weight, self.eps, backend=self.backend)


class Attention(nn.Module):
    def __init__(self, cfg: Config, derived: Derived, ps: ParallelState, tracker: RNGTracker):
        super().__init__()
        m, t = cfg.model, derived.tp
        self.head_dim = derived.head_dim
        self.local_heads, self.local_groups = m.n_head // t, derived.n_kv_head // t
        self.heads_per_group = m.n_head // derived.n_kv_head
        self.is_llama, self.rope_theta = m.arch == "llama", m.rope_theta
        self.dropout, self.tracker = m.dropout, tracker
        self.backend = cfg.kernels.backend
        self.selective_checkpoint = cfg.train.activation_checkpointing == "selective"
        self.cp = derived.cp
        self.ring = Ring.of(ps) if derived.cp > 1 else None
        bias, sp, group = m.arch == "gpt2", cfg.parallel.sequence_parallel, ps.tp_group
        qkv_out = (m.n_head + 2 * derived.n_kv_head) * self.head_dim
        self.qkv = ColumnParallelLinear(
            m.d_model, qkv_out, bias=bias, sequence_parallel=sp, tp_group=group, init_method=None
        )
        self.proj = RowParallelLinear(
            m.n_head * self.head_dim, m.d_model, bias=bias, sequence_parallel=sp,
            tp_group=group, init_method=None,
        )  # fmt: skip

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, n/t, s, d], k and v [b, k/t, s, d] -> [b, n/t, s, d]."""
        if self.ring is not None:  # this rank's zigzag shard: global positions, ring attention
            if self.is_llama:
                positions = zigzag_positions(q.shape[2], self.cp, self.ring.rank, q.device)
                q = ops.rope(q, self.rope_theta, backend=self.backend, positions=positions)
                k = ops.rope(k, self.rope_theta, backend=self.backend, positions=positions)
            return ring_attention(q, k, v, self.ring, backend=self.backend)
        if self.is_llama:
            q = ops.rope(q, self.rope_theta, backend=self.backend)
            k = ops.rope(k, self.rope_theta, backend=self.backend)
        if self.dropout > 0 and self.training:
            group = self.heads_per_group
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            with self.tracker.fork():  # heads differ per tp rank: a per-rank stream
                return F.scaled_dot_product_attention(
                    q, k, v, dropout_p=self.dropout, is_causal=True
                )
        return ops.attention(q, k, v, causal=True, backend=self.backend)

    def split_heads(self, x: torch.Tensor):
        """x [b, s, h] -> q [b, n/t, s, d], k and v [b, k/t, s, d] of this rank's heads."""
        qkv = self.qkv(x)  # [b, s, (n + 2k) / t * d]
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.local_groups, self.heads_per_group + 2, self.head_dim)
        # One split (its backward is one concatenation, not a zero-filled buffer per slice);
        # q is a view when each group has one query head (gpt2), a copy otherwise.
        q, k, v = qkv.split([self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(b, s, self.local_heads, self.head_dim)
        return q.transpose(1, 2), k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(x)
        b, s = q.shape[0], q.shape[2]
        if self.selective_checkpoint and self.training:
            y = checkpoint(self.core, self.tracker, q, k, v)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, n/t * d]
        return self.proj(y)

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention for incremental decoding: x [b, s, h] at positions start_pos.., cache the
        (k, v) [b, k/t, start_pos, d] of the earlier positions (None at 0) -> (output [b, s, h],
        the cache extended by these positions). RoPE rotates by the absolute positions."""
        q, k, v = self.split_heads(x)
        b, s = q.shape[0], q.shape[2]
        if self.is_llama:
            q = reference.rope(q, self.rope_theta, start_pos)
            k = reference.rope(k, self.rope_theta, start_pos)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        keys, values = k, v  # [b, k/t, start_pos + s, d]
        if self.heads_per_group > 1:
            keys = k.repeat_interleave(self.heads_per_group, dim=1)
            values = v.repeat_interleave(self.heads_per_group, dim=1)
        positions = torch.arange(start_pos, start_pos + s, device=x.device)
        visible = torch.arange(keys.shape[2], device=x.device)[None, :] <= positions[:, None]
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=1.0 / math.sqrt(self.head_dim)
        )
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # [b, s, n/t * d]
        return self.proj(y), (k, v)


class MLP(nn.Module):
    """The dense MLP (d_ff: derived.d_ff unless given, e.g. an MoE layer's shared expert)."""

    def __init__(self, cfg: Config, derived: Derived, ps: ParallelState, d_ff: int | None = None):
        super().__init__()
        m, sp, group = cfg.model, cfg.parallel.sequence_parallel, ps.tp_group
        d_ff = derived.d_ff if d_ff is None else d_ff
        self.is_llama, self.backend = m.arch == "llama", cfg.kernels.backend
        common = dict(sequence_parallel=sp, tp_group=group, init_method=None)
        if self.is_llama:
            self.gate = ColumnParallelLinear(m.d_model, d_ff, bias=False, **common)
            self.up = ColumnParallelLinear(m.d_model, d_ff, bias=False, **common)
        else:
            self.up = ColumnParallelLinear(m.d_model, d_ff, bias=True, skip_bias_add=True, **common)
        self.down = RowParallelLinear(d_ff, m.d_model, bias=not self.is_llama, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_llama:
            # gate and up read the same input: one f (or one sequence all-gather) for both, so
            # backward all-reduces their summed input gradient once, as a fused fc1 would.
            group = self.gate.tp_group
            x = to_autocast_dtype(x)
            if self.gate.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, group)  # [b, s, h]
            else:
                x = mappings.copy_to_tensor_parallel_region(x, group)
            gate, up = F.linear(x, self.gate.weight), F.linear(x, self.up.weight)  # [b, s, f/t]
            hidden = ops.swiglu(gate, up, backend=self.backend)
        elif ops.resolve_backend(self.backend, x) == "triton":  # the kernel adds the bias
            hidden = ops.bias_gelu(self.up(x), self.up.bias, backend="triton")
        else:  # torch adds the bias inside the matmul (addmm), as nn.Linear does
            hidden = ops.bias_gelu(self.up(x, add_bias=True), None, backend="torch")  # [b, s, f/t]
        return self.down(hidden)


class Block(nn.Module):
    """Transformer block `index`: attention, then a dense MLP, or a mixture of experts where
    index is one of derived.moe_layers."""

    def __init__(
        self, cfg: Config, derived: Derived, ps: ParallelState, tracker: RNGTracker, index: int
    ):
        super().__init__()
        m, sp = cfg.model, cfg.parallel.sequence_parallel and derived.tp > 1
        kind = "rmsnorm" if m.arch == "llama" else "layernorm"
        backend = cfg.kernels.backend
        self.norm1 = Norm(m.d_model, kind, m.norm_eps, backend, sp)
        self.attn = Attention(cfg, derived, ps, tracker)
        self.norm2 = Norm(m.d_model, kind, m.norm_eps, backend, sp)
        if index in derived.moe_layers:
            shared = MLP(cfg, derived, ps, derived.moe_d_ff) if m.moe.shared_expert else None
            self.mlp = MoELayer(cfg, derived, ps, shared)
        else:
            self.mlp = MLP(cfg, derived, ps)
        self.dropout, self.tracker, self.sequence_parallel = m.dropout, tracker, sp

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout == 0 or not self.training:
            return x
        if self.sequence_parallel:  # each tp rank holds different tokens
            with self.tracker.fork():
                return F.dropout(x, self.dropout, training=True)
        return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.norm1(x)))
        return x + self._drop(self.mlp(self.norm2(x)))

    def forward_cached(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, start_pos: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """forward for incremental decoding (eval: no dropout); see Attention.forward_cached."""
        attn, cache = self.attn.forward_cached(self.norm1(x), cache, start_pos)
        x = x + attn
        return x + self.mlp(self.norm2(x)), cache


def checkpoint(fn, tracker: RNGTracker, *args):
    """torch.utils.checkpoint that also replays the tracker's streams on recompute, so
    dropout inside the recomputed region draws the same masks as the first forward (and MoE
    layers do not count their routing twice)."""
    snapshot = tracker.get_states()
    calls = [0]

    def run(*inner):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inner)
        after = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            with recomputing():
                return fn(*inner)
        finally:
            tracker.set_states(after)

    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True
    )


class GPT(nn.Module):
    """The model on one tp rank of one pipeline stage. With pp = 1 (one stage):
    forward(tokens [b, s]) -> this rank's logits [b, s, V / t] (padding ids beyond the real vocab
    are -inf); loss(tokens, targets) -> mean loss.

    With pp > 1 the stage holds its slice of the transformer layers (derived.stage_chunks), under
    their global names (blocks.<i>), so checkpoints are the same at any pp; the first stage also
    holds the embeddings, the last the final norm and the output layer. stage_forward runs one
    stage. With parallel.pp_virtual = v > 1 the slice is v model chunks (`chunks`: the block
    names of each, rank r holding chunks r, r + pp, ...), each run by chunk_forward; the
    embeddings belong to chunk 0, the output layer to the last chunk. Tied embeddings (gpt2)
    put a copy of tok_emb on the last stage too: both copies are tagged pipeline_tied (their
    gradients are summed across the two stages) and the last stage's is tagged
    pipeline_duplicate (not saved, not counted twice in the gradient norm)."""

    def __init__(self, cfg: Config, derived: Derived, ps: ParallelState):
        super().__init__()
        m = cfg.model
        self.cfg, self.derived, self.ps = cfg, derived, ps
        self.tracker = RNGTracker(cfg.train.seed, ps.tp_rank, ps.device)
        self.sequence_parallel = cfg.parallel.sequence_parallel and derived.tp > 1
        self.backend = cfg.kernels.backend
        self.full_checkpoint = cfg.train.activation_checkpointing == "full"
        self.is_first_stage, self.is_last_stage = ps.is_first_stage, ps.is_last_stage
        V = derived.padded_vocab_size
        self.tok_emb = self.pos_emb = self.norm_f = self.lm_head = None
        if self.is_first_stage or (self.is_last_stage and derived.tie_embeddings):
            self.tok_emb = VocabParallelEmbedding(
                V, m.d_model, tp_group=ps.tp_group, init_method=None
            )
            self.tok_emb.weight.valid_rows = derived.vocab_size
            if derived.pp > 1 and derived.tie_embeddings:
                self.tok_emb.weight.pipeline_tied = True
                self.tok_emb.weight.pipeline_duplicate = not self.is_first_stage
        if self.is_first_stage and m.arch == "gpt2":
            self.pos_emb = nn.Embedding(m.max_seq_len, m.d_model)
            mark_parallel(self.pos_emb.weight, None, tuple(self.pos_emb.weight.shape))
        self.chunks = [[str(i) for i in layers] for layers in derived.stage_chunks(ps.pp_rank)]
        self.blocks = nn.ModuleDict(
            {
                name: Block(cfg, derived, ps, self.tracker, int(name))
                for chunk in self.chunks
                for name in chunk
            }
        )
        if self.is_last_stage:
            kind = "rmsnorm" if m.arch == "llama" else "layernorm"
            self.norm_f = Norm(m.d_model, kind, m.norm_eps, self.backend, self.sequence_parallel)
            if not derived.tie_embeddings:
                self.lm_head = ColumnParallelLinear(
                    m.d_model, V, bias=False, sequence_parallel=self.sequence_parallel,
                    tp_group=ps.tp_group, init_method=None,
                )  # fmt: skip
                self.lm_head.weight.valid_rows = derived.vocab_size
        local_v = V // derived.tp
        ids = torch.arange(ps.tp_rank * local_v, (ps.tp_rank + 1) * local_v)
        self.register_buffer("vocab_padding", ids >= derived.vocab_size, persistent=False)
        self.has_padding = bool(self.vocab_padding.any())
        self.to(ps.device)
        init_weights(self, cfg.train.seed, m.n_layer)

    def forward_param_uses(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """(module, the parameters used from its call on) in the order a forward calls the
        modules: the embeddings, the blocks, the final norm (followed by the LM head, which is
        not called as a module). A forward pre-hook on each module can make its parameters
        ready (ZeRO-1's all-gather overlapped with the forward: grads.GradBuffer)."""
        uses = [(m, list(m.parameters())) for m in (self.tok_emb, self.pos_emb) if m is not None]
        uses += [(block, list(block.parameters())) for block in self.blocks.values()]
        if self.norm_f is not None:
            head = list(self.lm_head.parameters()) if self.lm_head is not None else []
            uses.append((self.norm_f, list(self.norm_f.parameters()) + head))
        return uses

    def moe_layers(self) -> dict[int, MoELayer]:
        """This rank's mixture-of-experts MLPs by block index."""
        return {
            int(name): block.mlp
            for name, block in self.blocks.items()
            if isinstance(block.mlp, MoELayer)
        }

    def set_moe_loss_scale(self, scale: float) -> None:
        """The factor the micro-batches' losses are scaled by before backward (1 / the
        micro-batches per step): the MoE layers' router losses get the same."""
        for layer in self.moe_layers().values():
            layer.loss_scale = scale

    def activation_shape(self, micro_batch_size: int, seq_len: int) -> tuple[int, int, int]:
        """The shape of the hidden states that pass between pipeline stages (this rank's
        sequence shard under sequence parallelism)."""
        local = seq_len // self.derived.cp
        if self.sequence_parallel:
            local //= self.derived.tp
        return (micro_batch_size, local, self.cfg.model.d_model)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first stage's input layers: tokens [b, s] -> hidden [b, s, h] ([b, s/t, h] with
        sequence parallelism). Under cp, tokens are this rank's shard, at global positions."""
        x = self.tok_emb(tokens)  # [b, s, h]
        if self.pos_emb is not None:
            if self.derived.cp > 1:
                positions = zigzag_positions(
                    tokens.shape[1], self.derived.cp, self.ps.cp_rank, tokens.device
                )
            else:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.pos_emb(positions)
        if self.cfg.model.dropout > 0 and self.training:
            x = F.dropout(x, self.cfg.model.dropout)
        if self.sequence_parallel:
            x = mappings.scatter_to_sequence_parallel_region(x, self.ps.tp_group)  # [b, s/t, h]
        return x

    def stage_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """One pipeline stage (at pp_virtual 1): tokens (first stage) or the previous stage's
        hidden states -> hidden states for the next stage, or this rank's logits on the last
        stage."""
        if len(self.chunks) > 1:
            raise RuntimeError("an interleaved pipeline stage runs chunk by chunk (chunk_forward)")
        return self.chunk_forward(0, inputs)

    def chunk_forward(self, chunk: int, inputs: torch.Tensor) -> torch.Tensor:
        """This rank's model chunk `chunk` (0 .. pp_virtual - 1; global chunk pp_rank + chunk x
        pp): tokens [b, s] (global chunk 0) or the previous chunk's hidden states -> hidden
        states for the next chunk, or this rank's logits after the last chunk."""
        if self.is_first_stage and chunk == 0:
            with annotate("embed"):
                x = self.embed(inputs)
        else:
            x = inputs
        for name in self.chunks[chunk]:  # names are the global layer indices
            block = self.blocks[name]
            with annotate(f"block {name}"):
                if self.full_checkpoint and self.training:
                    x = checkpoint(block, self.tracker, x)
                else:
                    x = block(x)
        if not (self.is_last_stage and chunk == len(self.chunks) - 1):
            return x
        with annotate("logits"):
            return self.logits(self.norm_f(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.derived.pp > 1:
            raise RuntimeError("a model split into pipeline stages runs through stage_forward")
        return self.stage_forward(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer, column-parallel over the vocab: x [b, s, h] (or [b, s/t, h] with
        sequence parallelism) -> this rank's logits [b, s, V/t], padding ids at -inf."""
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = column_parallel_linear(x, weight, None, self.ps.tp_group, self.sequence_parallel)
        if self.has_padding:
            logits = logits.masked_fill(self.vocab_padding, float("-inf"))
        return logits

    def loss_of_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the tokens whose target is not -100. Under cp the count is
        the whole sequences' (summed over the cp group) and the value is scaled by cp, so the
        mean over the cp group of this loss (and of its gradients) is the full sequences'
        mean, however the targets that count fall on the cp ranks."""
        with annotate("loss"):
            per_token = ops.cross_entropy(logits, targets, self.ps.tp_group, backend=self.backend)
        count = (targets != -100).sum()
        if self.derived.cp > 1:
            count = count.to(torch.float64).reshape(1)
            comm.all_reduce(count, self.ps.cp_group)
            return per_token.float().sum() * self.derived.cp / count.clamp(min=1).float()[0]
        return per_token.float().sum() / count.clamp(min=1)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the tokens whose target is not -100 (one stage only)."""
        return self.loss_of_logits(self(tokens), targets)

    @torch.no_grad()
    def forward_cached(self, tokens: torch.Tensor, cache: list, start_pos: int) -> torch.Tensor:
        """Incremental decoding (generation; eval mode, one stage, no sequence parallelism):
        tokens [b, s] at positions start_pos..start_pos + s - 1 -> this rank's logits
        [b, s, V / t] for those positions, as forward on the whole sequence gives them. `cache`
        is a list, empty at start_pos 0, that holds each block's keys and values; it is
        updated in place."""
        if self.sequence_parallel or self.derived.pp > 1:
            raise RuntimeError("forward_cached runs at pp 1 with sequence_parallel false")
        s = tokens.shape[1]
        if start_pos + s > self.cfg.model.max_seq_len:
            raise ValueError(f"positions up to {start_pos + s} > max_seq_len")
        x = self.tok_emb(tokens)  # [b, s, h]
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(start_pos, start_pos + s, device=tokens.device))
        for index, block in enumerate(self.blocks.values()):
            x, kv = block.forward_cached(x, cache[index] if index < len(cache) else None, start_pos)
            if index < len(cache):
                cache[index] = kv
            else:
                cache.append(kv)
        return self.logits(self.norm_f(x))


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: GPT, seed: int, n_layer: int) -> None:
    """GPT-2-style initialization, layout-invariant: each full weight (each expert's, for
    stacked experts) is drawn from a generator seeded by (seed, its checkpoint name) and this
    rank keeps its block. Matrices and embeddings: normal(0, 0.02); residual outputs
    (attention proj, MLP and expert down): normal(0, 0.02 / sqrt(2 n_layer)); biases 0; norm
    weights 1."""
    ps = model.ps
    for name, param, index in stored_tensors(model.named_parameters()):
        target = param if index is None else param[index]
        if name.endswith(".bias"):
            target.zero_()
            continue
        if "norm" in name:
            target.fill_(1.0)
            continue
        std = (
            0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "down.weight")) else 0.02
        )
        full_shape = list(param.full_shape)
        rows = getattr(param, "valid_rows", full_shape[0])
        gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
        full = torch.zeros(full_shape)
        full[:rows].normal_(0.0, std, generator=gen)
        if param.tp_split_dim is not None:
            full = full.chunk(model.derived.tp, dim=param.tp_split_dim)[ps.tp_rank]
        target.copy_(full)
