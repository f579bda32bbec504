"""The components a model is built from, as model.arch's preset chooses them: its positions, its
norm and where the norm sits, its attention, its MLP and its biases. The model, the Hugging Face
mapping and the accounting ask a component, never the family: a new family is a new choice of
components (megatronish.config.presets), a new component a new value here and the code that
builds and costs it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Positions = Literal["learned", "rope"]
NormKind = Literal["layernorm", "rmsnorm"]
NormPlacement = Literal["pre", "sandwich"]
AttentionKind = Literal["mha", "mla", "gated_deltanet"]
Activation = Literal["gelu", "swiglu", "geglu", "clamped_swiglu"]
Biases = Literal["all", "qkv", "none"]
Output = Literal["tied", "separate"]


@dataclass(frozen=True)
class BlockComponents:
    """What a family's blocks are made of, and its output layer (the dense blocks' MLP;
    model.moe makes the MLP of some blocks a mixture of experts of the same activation:
    megatronish.config.moe_layers).

    positions: learned (a position table beside the token embedding) or rope (rotary, inside
    attention). norm: the norm's kind; norm_placement: pre (each sublayer reads the norm of the
    residual stream and adds its output to it, with one final norm) or sandwich (the sublayer's
    output is normed too before it is added: Gemma 3's four norms per block). attention: mha
    (multi-head, grouped-query) or mla (multi-head latent), the full attention of the blocks that
    model.layer_types leaves as such (the others run gated_deltanet, linear attention:
    ModelConfig.block_attention). mlp: gelu (up, GELU, down), swiglu (gate and up,
    SiLU(gate) * up, down), geglu (the same with the tanh GELU: Gemma 3) or clamped_swiglu
    (GPT-OSS: gate clamped above and up on both sides at model.swiglu_limit, then
    gate * sigmoid(1.702 gate) * (up + 1)). biases: all (every linear layer), qkv (the query,
    key and value projections only) or none. output: the output layer where
    model.tie_embeddings is null, tied (the token embedding's transpose) or
    separate (a weight of its own).

    norm_offset: what each norm adds to its learned weight before scaling, 0 (the weight is the
    scale, initialized to 1) or 1 (the scale is 1 + weight, the weight zero-initialized: Qwen3.5
    and Qwen3-Next); every norm of the model, the blocks', the final one and the q/k norms.
    attention_gate: the query projection also gives an output gate per head, and attention's
    output is multiplied by sigmoid(gate) before the output projection (Qwen3.5's full
    attention). embedding_scale: the token embeddings are multiplied by sqrt(d_model), the
    factor cast to their dtype (Gemma 3).
    attention_sinks: a learned logit per query head joins each softmax's denominator, with no
    value (GPT-OSS); split over tp with its head.
    biased_experts: the router's logits and each expert's gate, up and down projections have
    biases (GPT-OSS)."""

    positions: Positions
    norm: NormKind
    norm_placement: NormPlacement
    attention: AttentionKind
    mlp: Activation
    biases: Biases
    output: Output
    norm_offset: float = 0.0
    attention_gate: bool = False
    embedding_scale: bool = False
    attention_sinks: bool = False
    biased_experts: bool = False

    @property
    def rope(self) -> bool:
        """Rotary positions (inside attention), not a learned table."""
        return self.positions == "rope"

    @property
    def learned_positions(self) -> bool:
        """A position table beside the token embedding (its rows: model.max_seq_len)."""
        return self.positions == "learned"

    @property
    def linear_bias(self) -> bool:
        """Biases on every linear layer of the block (not only on the qkv projection)."""
        return self.biases == "all"

    @property
    def qkv_bias(self) -> bool:
        """Biases on the query, key and value projections."""
        return self.biases != "none"

    @property
    def gated_mlp(self) -> bool:
        """The MLP's first projection is two (gate and up) rather than one."""
        return self.mlp != "gelu"

    @property
    def sandwich_norms(self) -> bool:
        """Each sublayer's output normed before the residual add (two more norms per block)."""
        return self.norm_placement == "sandwich"

    @property
    def norm_weights(self) -> int:
        """Tensors of d_model elements in one norm: weight and bias (layernorm) or weight."""
        return 2 if self.norm == "layernorm" else 1

    @property
    def tied_output(self) -> bool:
        """The default of model.tie_embeddings: the output layer is the token embedding's."""
        return self.output == "tied"


GPT2 = BlockComponents(
    positions="learned",
    norm="layernorm",
    norm_placement="pre",
    attention="mha",
    mlp="gelu",
    biases="all",
    output="tied",
)
"""GPT-2's blocks: learned positions, LayerNorm, GELU, biases everywhere, a tied output layer."""

ROPE = BlockComponents(
    positions="rope",
    norm="rmsnorm",
    norm_placement="pre",
    attention="mha",
    mlp="swiglu",
    biases="none",
    output="separate",
)
"""The RoPE, RMSNorm and SwiGLU blocks every other family composes, with a separate output layer
(model.attention, qkv_bias choose the rest)."""

QWEN3_5 = replace(ROPE, norm_offset=1.0, attention_gate=True)
"""Qwen3.5's blocks: the RoPE blocks with zero-centered norms (scale 1 + weight) and a sigmoid
output gate on the full attention."""

GEMMA3 = replace(
    ROPE,
    norm_placement="sandwich",
    mlp="geglu",
    output="tied",
    norm_offset=1.0,
    embedding_scale=True,
)
"""Gemma 3's blocks: the RoPE blocks with sandwich norms of scale 1 + weight, GeGLU, embeddings
scaled by sqrt(d_model) and a tied output layer."""

GPT_OSS = replace(
    ROPE, biases="all", mlp="clamped_swiglu", attention_sinks=True, biased_experts=True
)
"""GPT-OSS's blocks: the RoPE blocks with biases on every projection, attention sinks, the
clamped SwiGLU, and biased experts and router."""
