"""GPT: the model of one tp rank of one pipeline stage (embeddings, blocks, final norm,
logits, the multi-token prediction modules); what training minimizes is megatronish.objectives,
incremental decoding megatronish.inference.decode.

Shapes (legend in megatronish.model): b batch, s sequence, h d_model, V padded vocab,
t tp size.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.config import Config, Derived
from megatronish.context import Documents, zigzag_positions
from megatronish.distributed.layout import ParallelState, RNGTracker
from megatronish.layers import mappings
from megatronish.layers.embedding import VocabParallelEmbedding
from megatronish.layers.linear import (
    ColumnParallelLinear,
    column_parallel_linear,
    mark_parallel,
)
from megatronish.layers.roles import set_role
from megatronish.model.adapters import freeze_base
from megatronish.model.block import Block
from megatronish.model.init import init_weights
from megatronish.model.mtp import MTP
from megatronish.model.norm import Norm
from megatronish.model.plan import ModelPlan, block_plan, model_plan
from megatronish.model.recompute import checkpoint
from megatronish.moe import MoELayer
from megatronish.observe.profile import annotate


class GPT(nn.Module):
    """The model on one tp rank of one pipeline stage. With pp = 1 (one stage):
    forward(tokens [b, s]) -> this rank's logits [b, s, V / t] (padding ids beyond the real vocab
    are -inf); stage_forward -> the final hidden states, which an objective takes on through
    head and mtp_hidden (megatronish.objectives).

    With pp > 1 the stage holds its slice of the transformer layers (derived.stage_chunks), under
    their global names (blocks.<i>), so checkpoints are the same at any pp; the first stage also
    holds the embeddings, the last the final norm and the output layer. stage_forward runs one
    stage. With parallel.pp_virtual = v > 1 the slice is v model chunks (`chunks`: the block
    names of each, rank r holding chunks r, r + pp, ...), each run by chunk_forward; the
    embeddings belong to chunk 0, the output layer to the last chunk. Tied embeddings (gpt2)
    and multi-token prediction (model.mtp_depth, `mtp`: on the last stage) put a copy of
    tok_emb on the last stage too: both copies are tagged pipeline_tied (their gradients are
    summed across the two stages) and the last stage's is tagged pipeline_duplicate (not
    saved, not counted twice in the gradient norm). `plan`: each layer's numeric format and
    communication schedule (default: cfg's, megatronish.model.plan)."""

    def __init__(
        self, cfg: Config, derived: Derived, ps: ParallelState, plan: ModelPlan | None = None
    ):
        super().__init__()
        model = cfg.model
        plan = model_plan(cfg, derived, ps) if plan is None else plan
        self.logits_plan = plan.others
        self.cfg, self.derived, self.ps = cfg, derived, ps
        self.tracker = RNGTracker(cfg.train.seed, ps.tp_rank, ps.device)
        self.sequence_parallel = cfg.parallel.sequence_parallel and derived.tp > 1
        self.backend = cfg.kernels.backend
        self.full_checkpoint = cfg.train.activation_checkpointing == "full"
        self.is_first_stage, self.is_last_stage = ps.is_first_stage, ps.is_last_stage
        V = derived.padded_vocab_size
        self.tok_emb = self.pos_emb = self.norm_f = self.lm_head = None
        if self.is_first_stage or (self.is_last_stage and derived.last_stage_embedding):
            self.tok_emb = VocabParallelEmbedding(
                V, model.d_model, tp_group=ps.tp_group, init_method=None
            )
            set_role(self.tok_emb.weight, valid_rows=derived.vocab_size)
            if derived.pp > 1 and derived.last_stage_embedding:
                duplicate = not self.is_first_stage
                set_role(self.tok_emb.weight, pipeline_tied=True, pipeline_duplicate=duplicate)
        if self.is_first_stage and model.components.learned_positions:
            self.pos_emb = nn.Embedding(model.max_seq_len, model.d_model)
            mark_parallel(self.pos_emb.weight, None, tuple(self.pos_emb.weight.shape))
        self.chunks = [[str(i) for i in layers] for layers in derived.stage_chunks(ps.pp_rank)]
        plan_of = partial(block_plan, cfg, derived, ps, self.tracker, linear=plan.blocks)
        self.blocks = nn.ModuleDict(
            {name: Block(model, plan_of(int(name))) for chunk in self.chunks for name in chunk}
        )
        if self.is_last_stage:
            parts = model.components
            norm = (parts.norm, model.norm_eps, self.backend, self.sequence_parallel)
            self.norm_f = Norm(model.d_model, *norm, parts.norm_offset)
            if not derived.tie_embeddings:
                self.lm_head = ColumnParallelLinear(
                    model.d_model,
                    V,
                    bias=False,
                    sequence_parallel=self.sequence_parallel,
                    tp_group=ps.tp_group,
                    init_method=None,
                    plan=plan.others,
                )
                set_role(self.lm_head.weight, valid_rows=derived.vocab_size)
        self.mtp = None
        if self.is_last_stage and model.mtp_depth > 0:
            self.mtp = MTP(model, [plan_of(model.n_layer + k) for k in range(model.mtp_depth)])
        local_v = V // derived.tp
        ids = torch.arange(ps.tp_rank * local_v, (ps.tp_rank + 1) * local_v)
        self.register_buffer("vocab_padding", ids >= derived.vocab_size, persistent=False)
        self.has_padding = bool(self.vocab_padding.any())
        self.to(ps.device)
        init_weights(self, cfg.train.seed, model.n_layer)
        if model.lora is not None:
            freeze_base(self, cfg.train.bf16_autocast)

    def forward_param_uses(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """(module, the parameters used from its call on) in the order a forward calls the
        modules: the embeddings, the blocks, the final norm (followed by the LM head, which is
        not called as a module: its weight, or the tied embedding's, and by the multi-token
        prediction modules with the embedding they read, whose parameters it lists too: they
        run after the output layer, from the same gathered parameters). A forward pre-hook on
        each module can make its parameters ready (ZeRO-1's all-gather overlapped with the
        forward, ZeRO-3's gathers: megatronish.data_parallel)."""
        uses = [(m, list(m.parameters())) for m in (self.tok_emb, self.pos_emb) if m is not None]
        uses += [(block, list(block.parameters())) for block in self.blocks.values()]
        if self.norm_f is not None:
            head = self.lm_head if self.lm_head is not None else self.tok_emb
            after = [self.norm_f, head]
            if self.mtp is not None:
                after += [self.mtp] + ([self.tok_emb] if self.lm_head is not None else [])
            uses.append((self.norm_f, [p for m in after for p in m.parameters()]))
        return uses

    def moe_layers(self) -> dict[int, MoELayer]:
        """This rank's mixture-of-experts MLPs by block index (a multi-token prediction
        module k's block: n_layer + k - 1)."""
        blocks = {int(name): block for name, block in self.blocks.items()}
        if self.mtp is not None:
            n_layer = self.cfg.model.n_layer
            blocks.update((n_layer + k, layer.block) for k, layer in enumerate(self.mtp.layers))
        return {i: block.mlp for i, block in blocks.items() if isinstance(block.mlp, MoELayer)}

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

    def scaled(self, embedded: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(d_model) (cast to their dtype) where the components
        scale them (Gemma 3), else as they are."""
        if not self.cfg.model.components.embedding_scale:
            return embedded
        return embedded * torch.tensor(self.cfg.model.d_model**0.5, dtype=embedded.dtype)

    def embed(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The first stage's input layers: tokens [b, s] -> hidden [b, s, h] ([b, s/t, h] with
        sequence parallelism). Under cp, tokens are this rank's shard, at global positions;
        under document masks, at their positions within their documents."""
        x = self.scaled(self.tok_emb(tokens))  # [b, s, h]
        if self.pos_emb is not None:
            if documents is not None:
                positions = documents.positions  # [b, s]
            elif self.derived.cp > 1:
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

    def stage_forward(
        self, inputs: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """One pipeline stage (at pp_virtual 1): tokens (first stage) or the previous stage's
        hidden states -> hidden states for the next stage, or this rank's logits on the last
        stage. documents: those of the micro-batch's tokens under document masks (every stage
        needs them)."""
        if len(self.chunks) > 1:
            raise RuntimeError("an interleaved pipeline stage runs chunk by chunk (chunk_forward)")
        return self.chunk_forward(0, inputs, documents)

    def chunk_forward(
        self, chunk: int, inputs: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """This rank's model chunk `chunk` (0 .. pp_virtual - 1; global chunk pp_rank + chunk x
        pp): tokens [b, s] (global chunk 0) or the previous chunk's hidden states -> hidden
        states for the next chunk; after the last chunk the final hidden states, before the
        final norm (head and an objective take them on)."""
        if self.is_first_stage and chunk == 0:
            with annotate("embed"):
                x = self.embed(inputs, documents)
        else:
            x = inputs
        for name in self.chunks[chunk]:  # names are the global layer indices
            block = self.blocks[name]
            with annotate(f"block {name}"):
                if self.full_checkpoint and self.training:
                    x = checkpoint(block, self.tracker, x, documents)
                else:
                    x = block(x, documents)
        return x

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """tokens [b, s] -> this rank's logits [b, s, V / t] (one stage only)."""
        if self.derived.pp > 1:
            raise RuntimeError("a model split into pipeline stages runs through stage_forward")
        with annotate("logits"):
            return self.logits(self.norm_f(self.stage_forward(tokens, documents)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer, column-parallel over the vocab: x [b, s, h] (or [b, s/t, h] with
        sequence parallelism) -> this rank's logits [b, s, V/t], soft-capped where
        model.final_logit_softcapping says, padding ids at -inf."""
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = column_parallel_linear(
            x,
            weight,
            None,
            self.ps.tp_group,
            self.sequence_parallel,
            self.logits_plan,
        )
        cap = self.cfg.model.final_logit_softcapping
        if cap is not None:  # elementwise on this rank's vocab shard, as transformers orders it
            logits = torch.tanh(logits / cap) * cap
        if self.has_padding:
            logits = logits.masked_fill(self.vocab_padding, float("-inf"))
        return logits

    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's output layers: its final hidden states [b, s, h] -> (the hidden
        states after the final norm, this rank's logits [b, s, V / t])."""
        normed = self.norm_f(hidden)
        with annotate("logits"):
            return normed, self.logits(normed)

    def mtp_hidden(
        self,
        normed: torch.Tensor,
        future_tokens: torch.Tensor,
        documents: Documents | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The multi-token prediction modules' h^1 .. h^D [b, s, h] (each normed, the input of
        the output layer for its depth) from the main model's output after its final norm
        [b, s, h] and the input tokens ahead [b, D, s] (mtp.future_tokens_of, this cp rank's
        shard)."""
        # forward, not the module's call: its ZeRO-3 hooks are the first lookup's; the final
        # norm's gathered this embedding again (forward_param_uses)
        embedded = self.scaled(self.tok_emb.forward(future_tokens))  # [b, D, s, h]
        recompute = self.tracker if self.full_checkpoint and self.training else None
        with annotate("mtp"):
            return self.mtp(normed, embedded, documents, recompute)
