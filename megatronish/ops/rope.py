"""RoPE's frequencies: the one place that computes the inverse frequencies and the attention
factor of a rotary embedding, plain or scaled for a longer context (model.rope_scaling: linear,
Llama 3.1's llama3 and YaRN, as transformers computes them), and the cos / sin table built from
them. The torch rotation (ops.reference.rope) and the Triton kernel (which reads the table)
both take their table from `rope_table`.

Shapes: s positions, d head dim; the table is [s, d/2] (dim i pairs with dim i + d/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from megatronish.config.schema import ModelConfig


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: every frequency divided by factor (Gemma 3's global layers)."""

    factor: float

    def inverse_frequencies(self, powers: torch.Tensor, theta: float) -> torch.Tensor:
        """fp32 [d/2] from powers = theta^(2i/d) [d/2]: the plain ones over factor."""
        return 1.0 / powers / self.factor

    def cos_sin_factor(self) -> float:
        return 1.0


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequencies: the wavelengths (2 pi / inverse frequency) longer than
    original_max_position_embeddings / low_freq_factor are slowed by factor, those shorter than
    original_max_position_embeddings / high_freq_factor are kept, and those between are a linear
    blend of the two whose weight is original_max_position_embeddings / wavelength, from
    low_freq_factor (slowed) to high_freq_factor (kept)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def inverse_frequencies(self, powers: torch.Tensor, theta: float) -> torch.Tensor:
        """fp32 [d/2] from powers = theta^(2i/d) [d/2] (the plain inverse frequencies'
        reciprocals); the bands follow from the plain frequencies alone (theta unused)."""
        plain = 1.0 / powers
        wavelength = 2 * math.pi / plain
        context = self.original_max_position_embeddings
        kept = wavelength < context / self.high_freq_factor
        slowed = wavelength > context / self.low_freq_factor
        weight = (context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - weight) * plain / self.factor + weight * plain
        return torch.where(slowed, plain / self.factor, torch.where(kept, plain, blended))

    def cos_sin_factor(self) -> float:
        return 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023): a dimension that turns more than beta_fast times over the
    original context keeps its frequency, one that turns fewer than beta_slow times is slowed
    by factor, and a linear ramp over the dimensions between blends the two; cos and sin are
    multiplied by the attention factor (model.rope_scaling.attention_factor)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def _dimension(self, turns: float, head_dim: int, theta: float) -> float:
        """The (fractional) dimension pair whose frequency turns `turns` times over the
        original context."""
        context = self.original_max_position_embeddings
        return (head_dim * math.log(context / (turns * 2 * math.pi))) / (2 * math.log(theta))

    def inverse_frequencies(self, powers: torch.Tensor, theta: float) -> torch.Tensor:
        """fp32 [d/2] from powers = theta^(2i/d) [d/2]."""
        head_dim = 2 * powers.shape[0]
        first = self._dimension(self.beta_fast, head_dim, theta)
        last = self._dimension(self.beta_slow, head_dim, theta)
        if self.truncate:
            first, last = math.floor(first), math.ceil(last)
        first, last = max(first, 0), min(last, head_dim - 1)
        if first == last:
            last += 0.001  # a ramp of one step, not a division by zero
        pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=powers.device)
        ramp = torch.clamp((pairs - first) / (last - first), 0, 1)
        keep = 1 - ramp  # the weight of the plain frequency
        return 1.0 / (self.factor * powers) * (1 - keep) + 1.0 / powers * keep

    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor, 1.0)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    """What a rotary embedding rotates by: its base theta and its context scaling (None: plain
    RoPE, inverse frequency theta^(-2i/d) of dim pair i)."""

    theta: float = 10000.0
    scaling: LinearScaling | Llama3Scaling | YarnScaling | None = None

    def inverse_frequencies(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """fp32 [d/2]: the angle per position of each dim pair."""
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        powers = self.theta**exponents
        if self.scaling is None:
            return 1.0 / powers
        return self.scaling.inverse_frequencies(powers, self.theta)

    def attention_factor(self) -> float:
        """The multiplier of cos and sin (1 but for YaRN)."""
        return 1.0 if self.scaling is None else self.scaling.cos_sin_factor()


PLAIN = RopeSpec()
_SCALINGS = {"linear": LinearScaling, "llama3": Llama3Scaling, "yarn": YarnScaling}


def rope_spec(model: ModelConfig, sliding: bool = False) -> RopeSpec:
    """The RoPE of a model config's blocks: model.rope_theta and model.rope_scaling, or for a
    sliding-window block (`sliding`) model.rope_local_base_freq unscaled where it is set."""
    config = model.rope_scaling
    if sliding and model.rope_local_base_freq is not None:
        return RopeSpec(model.rope_local_base_freq)
    if config is None:
        return RopeSpec(model.rope_theta)
    kind = _SCALINGS[config.type]
    return RopeSpec(
        model.rope_theta, kind(**{f.name: getattr(config, f.name) for f in fields(kind)})
    )


def rope_table(
    spec: RopeSpec,
    seq_len: int,
    head_dim: int,
    device: torch.device,
    start_pos: int = 0,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, d/2] fp32, times the attention factor, for positions start_pos..start_pos
    + s - 1, or for the given int64 positions [s] or [b, s] ([b, s, d/2] then; the same values
    at a position as in the 0.. table)."""
    n_positions = start_pos + seq_len if positions is None else int(positions.max()) + 1
    inv_freq = spec.inverse_frequencies(head_dim, device)
    angles = torch.outer(torch.arange(n_positions, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    factor = spec.attention_factor()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    if positions is None:
        return cos[start_pos:], sin[start_pos:]
    return cos[positions], sin[positions]
