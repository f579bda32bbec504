"""A step's rollouts as the caller gives them (sequences, prompt lengths, advantages, the old
and reference log-probabilities), checked, and laid out on a packed row's tokens as the loss
takes them (rl.losses.TokenTerms).

Legend: n_i sequence i's length, p_i its prompt length, L a row's length. Row position j of
sequence i (at offset o) predicts its token t = j - o + 1, a completion token when t >= p_i:
sequence i has n_i - max(p_i, 1) completion tokens (its first token is never predicted)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megatronish.errors import UserError
from megatronish.rl.losses import TokenTerms, sequence_weights
from megatronish.rl.packing import Row, per_token, shard_row


def check_seqs(seqs: list[list[int]], vocab_size: int, max_len: int) -> None:
    """UserError naming the first sequence that is shorter than 2 tokens, longer than
    model.max_seq_len, or holds an id outside the vocabulary."""
    if not seqs:
        raise UserError("seqs: no sequences; give a list of token-id lists")
    for index, seq in enumerate(seqs):
        if not 2 <= len(seq) <= max_len:
            raise UserError(
                f"seqs[{index}]: {len(seq)} tokens; a sequence needs 2 to model.max_seq_len = "
                f"{max_len} tokens"
            )
        if min(seq) < 0 or max(seq) >= vocab_size:
            raise UserError(f"seqs[{index}]: a token id outside 0 .. {vocab_size - 1}")


def completion_counts(seqs: list[list[int]], prompt_lens: list[int]) -> list[int]:
    """The completion tokens of each sequence: those at positions >= its prompt length (the
    first token, never predicted, never counts)."""
    return [max(len(seq) - max(p, 1), 0) for seq, p in zip(seqs, prompt_lens, strict=True)]


@dataclass
class Rollouts:
    """One step's rollouts, each argument one entry per sequence."""

    seqs: list[list[int]]
    prompt_lens: list[int]
    advantages: list[float]
    old: list[torch.Tensor] | None = None
    ref: list[torch.Tensor] | None = None

    def __post_init__(self):
        n = len(self.seqs)
        for name in ("prompt_lens", "advantages", "old", "ref"):
            given = getattr(self, name)
            if given is not None and len(given) != n:
                raise UserError(f"{name}: {len(given)} entries for {n} sequences; give one each")
        for name in ("old", "ref"):
            for index, (values, seq) in enumerate(zip(getattr(self, name) or [], self.seqs)):
                if len(values) != len(seq) - 1:
                    raise UserError(
                        f"{name}_logprobs[{index}]: {len(values)} values for a sequence of "
                        f"{len(seq)} tokens; give len(seq) - 1, as logprobs() returns them"
                    )
        for index, (p, seq) in enumerate(zip(self.prompt_lens, self.seqs)):
            if not 0 <= p <= len(seq):
                raise UserError(f"prompt_lens[{index}]: {p} is not in 0 .. {len(seq)}")

    def terms(self, row: Row, kind: str, longest: int) -> TokenTerms:
        """The loss terms of a whole packed row's tokens [L] (the filler: mask 0, segment
        len(row.members)), on the CPU."""
        counts = completion_counts(self.seqs, self.prompt_lens)
        weights = sequence_weights(kind, counts, longest)
        total = max(sum(counts), 1)
        lengths = [len(self.seqs[i]) for i in row.members]
        masks = [
            (torch.arange(1, n) >= self.prompt_lens[i]).to(torch.float64)
            for i, n in zip(row.members, lengths, strict=True)
        ]

        def laid(values: list) -> torch.Tensor:
            return per_token(row, values, row.length)[0]

        def each(of: list) -> list[torch.Tensor]:
            return [torch.full((n - 1,), float(of[i])) for i, n in zip(row.members, lengths)]

        mask = laid(masks)
        segments = torch.full((row.length,), len(row.members), dtype=torch.int64)
        for segment, (offset, n) in enumerate(zip(row.offsets, lengths, strict=True)):
            segments[offset : offset + n] = segment
        row_counts = [float(counts[i]) for i in row.members] + [0.0]
        return TokenTerms(
            advantages=laid(each(self.advantages)),
            weights=mask * laid(each(weights)),
            shares=mask / total,
            segments=segments,
            mask=mask,
            counts=torch.tensor(row_counts, dtype=torch.float64),
            old=None if self.old is None else laid([self.old[i] for i in row.members]),
            ref=None if self.ref is None else laid([self.ref[i] for i in row.members]),
        )


def weightless(terms: TokenTerms) -> TokenTerms:
    """terms that add nothing to the loss or the metrics (a filler micro-batch's)."""
    return replace(terms, weights=terms.weights * 0, shares=terms.shares * 0)


def shard_terms(terms: TokenTerms, cp: int, cp_rank: int, device: torch.device) -> TokenTerms:
    """The terms of this cp rank's zigzag shard of the row (counts stay whole) on device, the
    floating ones in fp32 (as the log-probabilities they meet)."""
    changed = {}
    for f in fields(terms):
        value = getattr(terms, f.name)
        if value is None:
            continue
        if f.name != "counts":
            value = shard_row(value[None], cp, cp_rank)[0]
        value = value.to(device)
        changed[f.name] = value.float() if value.is_floating_point() else value
    return replace(terms, **changed)
