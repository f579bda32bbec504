"""The projection shapes of multi-head latent attention (model.mla), derived once for the
model (megatronish.model.mla) and the accounting."""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.config.schema import ModelConfig


@dataclass(frozen=True)
class MlaShapes:
    """model.mla's widths over `heads` query heads (all of them, or one tp rank's)."""

    heads: int
    q_rank: int | None
    """q_lora_rank; None: one query projection from the layer input."""
    kv_rank: int
    nope: int
    """The query-key head dim without rotary positions (qk_nope_head_dim)."""
    rope: int
    """The rotary query-key head dim (qk_rope_head_dim), and the width of the shared key."""
    v: int
    """The value head dim."""

    @property
    def qk(self) -> int:
        """The query-key head dim: nope + rope."""
        return self.nope + self.rope

    @property
    def q_out(self) -> int:
        """Output width of the query projection (q or q_b): heads x (nope + rope)."""
        return self.heads * self.qk

    @property
    def latent(self) -> int:
        """Output width of kv_a: the kv latent and the shared rotary key, what the decode
        cache holds a token."""
        return self.kv_rank + self.rope

    @property
    def kv_b_out(self) -> int:
        """Output width of kv_b: heads x (nope + v)."""
        return self.heads * (self.nope + self.v)

    @property
    def proj_in(self) -> int:
        """Input width of the output projection: heads x v."""
        return self.heads * self.v

    @property
    def entering_tp(self) -> int:
        """Width of the replicated down-projections' outputs that enter the tp region together
        (the query latent, the normed kv latent and the rotary key)."""
        return (self.q_rank or 0) + self.latent

    @property
    def normed(self) -> int:
        """Width of the latents' norms' inputs: the query latent's and the kv latent's."""
        return (self.q_rank or 0) + self.kv_rank


def mla_shapes(model: ModelConfig, heads: int | None = None) -> MlaShapes:
    """The shapes of model.mla over `heads` query heads (None: model.n_head)."""
    mla = model.mla
    return MlaShapes(
        heads=model.n_head if heads is None else heads,
        q_rank=mla.q_lora_rank,
        kv_rank=mla.kv_lora_rank,
        nope=mla.qk_nope_head_dim,
        rope=mla.qk_rope_head_dim,
        v=mla.v_head_dim,
    )
