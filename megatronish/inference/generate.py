"""`megatronish generate`: sampling from a checkpoint with a KV cache (inference.decode).

In one process the checkpoint is re-sharded to tp 1; under torchrun each of the WORLD_SIZE
ranks holds its tp shard, the logits are all-gathered over the vocab, every rank samples with
the same seeded generator and rank 0's token is broadcast, so all ranks feed the same token.
"""

from __future__ import annotations

import codecs
import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatronish.checkpoint.integrity import CorruptCheckpoint, first_message_of_ranks
from megatronish.checkpoint.load import inference_config
from megatronish.checkpoint.reader import Checkpoint
from megatronish.config import derive
from megatronish.distributed import comm
from megatronish.distributed.layout import (
    ParallelState,
    default_device,
    init_distributed,
    world_size_from_env,
)
from megatronish.errors import UserError
from megatronish.inference.decode import decode_step
from megatronish.inference.model import build_model
from megatronish.layers import mappings
from megatronish.moe.replay import Tape, recording


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax). Otherwise softmax(logits / temperature), restricted to
    the top_k most likely tokens (0: all) and to the smallest set whose probability reaches
    top_p (nucleus; 1: all)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # nan, inf too
            raise UserError(
                f"--temperature {self.temperature}: must be a finite number >= 0 (0: greedy)"
            )
        if self.top_k < 0:
            raise UserError(f"--top-k {self.top_k}: must be >= 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p}: must be in (0, 1]")


def decodable_mask(tokenizer, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: the ids of a model's vocabulary that the tokenizer decodes. A padded
    vocabulary (an import's, or model.vocab_size above the data's) has ids past the tokenizer's;
    those, and ids a tokenizer leaves unused, are never sampled."""
    ids = torch.from_numpy(tokenizer.decodable_ids()).long()
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids[(ids >= 0) & (ids < vocab_size)]] = True
    return mask


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """A token id drawn from logits [V] (on the CPU) as `sampling` says."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = probs.cumsum(-1) - probs >= sampling.top_p  # keeps at least the first
        logits = torch.full_like(logits, float("-inf")).scatter(
            0, order, ordered.masked_fill(outside, float("-inf"))
        )
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class StreamDecoder:
    """Text of a growing token sequence in printable pieces. Byte tokenizer: an incremental
    UTF-8 decoder, so a multi-byte character comes out once all its bytes have. Others: the
    whole sequence is decoded and the new text emitted, held back while it ends in U+FFFD
    (an incomplete character)."""

    def __init__(self, tokenizer):
        from megatronish.data import ByteTokenizer

        self.tokenizer = tokenizer
        self.is_bytes = isinstance(tokenizer, ByteTokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token: int) -> str:
        if self.is_bytes:
            return self._utf8.decode(bytes([token]))
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.emitted = text[self.emitted :], len(text)
        return piece

    def flush(self) -> str:
        if self.is_bytes:
            return self._utf8.decode(b"", final=True)
        text = self.tokenizer.decode(self.ids)
        piece, self.emitted = text[self.emitted :], len(text)
        return piece


class Generation:
    """Iterating yields the new token ids, drawn only among the ids `decodable` (bool [V] over
    the model's vocabulary: decodable_mask) allows; the end-of-text token ends it and is not
    yielded. Afterwards stop_reason is "eot", "max_new_tokens" or "max_seq_len", and cache
    holds each layer's decode cache (this rank's: keys and values of its heads, or under multi-head
    latent attention the latent and the shared rotary key) of the cached_tokens positions; a
    linear-attention layer's (model.layer_types) is its convolution tail and recurrent state,
    the same size at every position. With record_routes, routes then holds every fed token's
    experts per MoE layer (moe.replay: int64 [n_moe, cached_tokens, k]), what the trainer's
    routing replay forces."""

    def __init__(
        self,
        model,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        seed: int,
        eot_id: int | None,
        decodable: torch.Tensor,
        record_routes: bool = False,
    ):
        self.model, self.prompt_ids, self.max_new_tokens = model, prompt_ids, max_new_tokens
        self.tape = Tape(model.derived.moe_layers) if record_routes else None
        self.sampling, self.seed, self.eot_id, self.decodable = sampling, seed, eot_id, decodable
        self.stop_reason: str | None = None
        self.cache: list = []
        self.cached_tokens = 0

    def _agree(self, token: int) -> int:
        """The first tp rank's token, on every rank of the model's tp group."""
        ps = self.model.ps
        value = torch.tensor([token], dtype=torch.int64, device=ps.device)
        comm.broadcast(value, ps.tp_ranks[0], ps.tp_group)
        return int(value.item())

    @torch.no_grad()
    def __iter__(self) -> Iterator[int]:
        model, ps = self.model, self.model.ps
        max_len = model.cfg.model.max_seq_len
        generator = torch.Generator().manual_seed(self.seed)
        prompt = torch.tensor([self.prompt_ids], dtype=torch.int64, device=ps.device)
        logits = self._decode(prompt, 0)  # [1, V / t]
        pos = self.cached_tokens = len(self.prompt_ids)  # the position sampled next
        for produced in range(self.max_new_tokens):
            if pos >= max_len:
                self.stop_reason = "max_seq_len"
                return
            full = mappings.gather_from_tensor_parallel_region(logits, ps.tp_group)  # [1, V]
            drawable = full[0, : self.decodable.numel()].float().cpu()
            drawable = drawable.masked_fill(~self.decodable, float("-inf"))  # greedy too
            token = next_token(drawable, self.sampling, generator)
            token = self._agree(token)
            if token == self.eot_id:
                self.stop_reason = "eot"
                return
            yield token
            pos += 1
            if produced + 1 < self.max_new_tokens and pos < max_len:
                step = torch.tensor([[token]], dtype=torch.int64, device=ps.device)
                logits = self._decode(step, pos - 1)
                self.cached_tokens = pos
        self.stop_reason = "max_new_tokens"

    def _decode(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """The last position's logits [1, V / t] of decode_step, the routes recorded."""
        with recording(self.tape) if self.tape is not None else contextlib.nullcontext():
            return decode_step(self.model, tokens, self.cache, start_pos)[:, -1]

    @property
    def routes(self) -> torch.Tensor:
        """int64 [n_moe, cached_tokens, k]: the experts of every token fed (record_routes)."""
        if self.tape is None:
            raise RuntimeError("routes are recorded only with record_routes=True")
        return self.tape.routes()

    def cache_bytes(self) -> tuple[int, list[int]]:
        """(bytes of this rank's fixed decode cache: the linear-attention layers' recurrent state
        and convolution tail; bytes per token of each layer whose cache grows: the others')
        after iterating."""
        tokens, model = max(self.cached_tokens, 1), self.model.cfg.model
        fixed, growing = 0, []
        for index, layer in enumerate(self.cache):
            held = sum(t.numel() * t.element_size() for t in layer)
            if model.block_attention(index) == "gated_deltanet":
                fixed += held
            else:
                growing.append(held // tokens)
        return fixed, growing


def generate_text(
    checkpoint: str | os.PathLike[str],
    prompt: str,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    write: Callable[[str], None],
) -> Generation:
    """Streams the prompt, then its continuation, through write() (rank 0 only) and returns the
    finished Generation (its stop reason and decode cache). Runs at tp = WORLD_SIZE under
    torchrun, else in this process at tp 1."""
    sampling.check()
    if max_new_tokens < 0:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be >= 0")
    ckpt = Checkpoint(checkpoint)
    tokenizer = ckpt.tokenizer()
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
    max_len = ckpt.config.model.max_seq_len
    if len(ids) >= max_len:
        raise UserError(
            f"--prompt: {len(ids)} tokens, but the model's max_seq_len is {max_len}; use a "
            "shorter prompt"
        )
    world = world_size_from_env()
    if world > 1:
        cfg = inference_config(ckpt.config, ckpt.vocab_size, world)
        derive(cfg, world, vocab_size=ckpt.vocab_size)  # a tp that does not fit fails here
        ps = init_distributed(world, 1, cfg.parallel.timeout_s)
    else:
        ps = ParallelState.single(default_device())
    try:
        corrupt = None
        try:
            ckpt.check_in_background(ckpt.share(ps.rank, ps.world_size))
            model = build_model(ckpt, ps)
            ckpt.verify(ckpt.share(ps.rank, ps.world_size))
        except CorruptCheckpoint as exc:
            corrupt = str(exc)
        corrupt = first_message_of_ranks(corrupt, ps.world_size)
        if corrupt is not None:  # every rank stops; rank 0 says why
            raise UserError(corrupt, rank0_prints=True)
        decoder = StreamDecoder(tokenizer)
        if ps.is_main:
            write(prompt)
        decodable = decodable_mask(tokenizer, ckpt.vocab_size)
        generation = Generation(
            model, ids, max_new_tokens, sampling, seed, tokenizer.eot_id, decodable
        )
        for token in generation:
            if ps.is_main:
                write(decoder.push(token))
        if ps.is_main:
            write(decoder.flush())
        generation.stop_reason = generation.stop_reason or "max_new_tokens"
        return generation
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
