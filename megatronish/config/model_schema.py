"""The model section of the config schema: model.* (ModelConfig), its sub-sections model.moe.*
(MoEConfig), model.mla.* (MLAConfig) and model.rope_scaling (RopeScalingConfig), each key a
field documented where it is declared, as in config.schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatronish.config.components import AttentionKind, BlockComponents
from megatronish.config.lora import LoraConfig
from megatronish.config.presets import components_of


@dataclass
class MoEConfig:
    num_experts: int = 0
    """Experts of each mixture-of-experts MLP; 0: every block has a dense MLP."""
    top_k: int = 2
    """Experts each token is routed to (1 <= top_k <= num_experts)."""
    d_ff: int | None = None
    """Inner size of one expert (SwiGLU), divisible by parallel.tp. Default: model.d_ff."""
    every: int = 1
    """An MoE MLP in every this-many-th block (blocks 0, every, 2 every, ...), dense elsewhere."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer eq. 4: coef x num_experts x the sum
    over experts of the fraction of routed tokens times the mean router probability; coef at
    perfect balance), per MoE layer, averaged over the MoE layers."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE: mean over tokens of logsumexp(router logits)^2)."""
    capacity_factor: float | None = None
    """null: dropless. A number c: each expert takes at most ceil(c x tokens x top_k /
    num_experts) of the routed tokens of a rank's micro-batch (first choices first, then in
    token order); the others are dropped (their expert output is 0: the token passes through
    the residual) and counted in metrics.jsonl's moe_dropped_frac."""
    router: Literal["softmax_topk", "topk_softmax", "sigmoid"] = "softmax_topk"
    """softmax_topk: softmax over all experts, the top_k kept and renormalized to sum 1
    (Mixtral); topk_softmax: the top_k logits, then a softmax over them; sigmoid (DeepSeek-V3):
    sigmoid scores, the experts chosen by the top_k of score + a per-expert bias (see
    bias_update_speed), weighted by their unbiased scores normalized to sum 1, times
    routed_scaling_factor. The balancing loss's router probabilities are then the scores
    normalized over all experts."""
    n_group: int = 1
    """Expert groups of group-limited routing (sigmoid router): the num_experts experts split
    into n_group contiguous groups, ranked per token by the sum of each group's two best biased
    scores; a token goes only to experts of its topk_group best groups. 1: no groups."""
    topk_group: int = 1
    """The groups a token may be routed to (1 <= topk_group <= n_group, and topk_group x
    num_experts / n_group >= top_k)."""
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' combine weights (sigmoid router)."""
    bias_update_speed: float = 0.0
    """Auxiliary-loss-free balancing (sigmoid router; 0: off): after each optimizer step every
    expert's routing bias moves by this much towards balance, bias += speed x sign(mean load -
    its load), the loads counted over the whole global batch (every micro-batch and rank), so
    the biases are the same at every layout. The biases are model state that checkpoints save
    and restore, not trained parameters."""
    seq_aux_loss_coef: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balancing loss (0: off): per sequence of T tokens,
    the sum over experts of f_i P_i, f_i = num_experts / (top_k T) x the tokens choosing expert
    i, P_i the sequence's mean of the expert's score normalized over all experts; averaged over
    the sequences, per MoE layer, averaged over the MoE layers."""
    n_shared_experts: int = 0
    """Always-on experts beside the routed ones: one SwiGLU MLP of n_shared_experts x the
    expert d_ff on every token, added to the routed output (DeepSeek). 0: none."""
    shared_expert: bool = False
    """One shared expert: the same as n_shared_experts=1 (set one or the other)."""
    shared_expert_gate: bool = False
    """The shared experts' output multiplied by sigmoid(w . x) per token before it is added (w
    one learned vector of d_model per MoE layer, replicated over tp: Qwen3.5-MoE's
    shared_expert_gate); needs shared experts."""
    first_k_dense: int = 0
    """The first this-many blocks have dense MLPs (model.d_ff); MoE blocks are then those at
    index i >= first_k_dense with i a multiple of model.moe.every."""


@dataclass
class MLAConfig:
    q_lora_rank: int | None = None
    """Rank of the queries' low-rank path (down-projection from d_model, RMSNorm, up-projection
    to n_head x (qk_nope_head_dim + qk_rope_head_dim)); null: one projection from d_model."""
    kv_lora_rank: int | None = None
    """Size of the compressed key-value latent (after its RMSNorm, the per-token state that
    generate caches). Required with model.attention mla."""
    qk_nope_head_dim: int | None = None
    """Per-head size of the query and key part without position (the keys' from the latent).
    Required with model.attention mla."""
    qk_rope_head_dim: int | None = None
    """Size of the rotary part of each query head and of the one rotary key all heads share
    (decoupled RoPE), even. Required with model.attention mla."""
    v_head_dim: int | None = None
    """Per-head size of the values (from the latent); the output projection is n_head x
    v_head_dim to d_model. Required with model.attention mla."""


@dataclass
class ModelConfig:
    arch: Literal[
        "gpt2",
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen3_5",
        "deepseek_v3",
        "gemma3",
        "gpt_oss",
    ] = "gpt2"
    """A family's preset. gpt2: learned positions, LayerNorm, GELU, biases, tied embeddings.
    Every other family has RoPE, RMSNorm, SwiGLU, grouped-query attention and an untied output
    layer, and its preset fills the defaults of the component keys a config leaves unset (a key
    set in the file, to null too, or by --set wins): llama and mistral none; qwen2 qkv_bias,
    norm_eps 1e-6, rope_theta 1e6; qwen3 qk_norm, norm_eps 1e-6, rope_theta 1e6; qwen3_moe those
    of qwen3 and model.moe.aux_loss_coef 0.001, z_loss_coef 0 (a softmax_topk router);
    deepseek_v3 (DeepSeek-V3's config.json) attention mla with its model.mla sizes (not filled
    where model.attention is set to mha), norm_eps 1e-6, YaRN rope_scaling (factor 40 over 4096
    positions, mscale and mscale_all_dim 1) and the sigmoid router's model.moe keys (n_group 8,
    topk_group 4, routed_scaling_factor 2.5, seq_aux_loss_coef 0.001, n_shared_experts 1,
    first_k_dense 3, aux_loss_coef and z_loss_coef 0; bias_update_speed 0.001, the paper's, as
    config.json has none); qwen3_5 (transformers' Qwen3_5TextConfig) qk_norm, head_dim 256,
    partial_rotary_factor 0.25, norm_eps 1e-6, rope_theta 1e4, untied, with zero-centered norms
    (scale 1 + weight) and a sigmoid output gate on attention; gemma3 (transformers'
    Gemma3TextConfig) qk_norm, head_dim 256, query_pre_attn_scalar 256, norm_eps 1e-6,
    rope_theta 1e6, rope_local_base_freq 1e4, tied, with sandwich norms of scale 1 + weight,
    GeGLU and embeddings scaled by sqrt(d_model); gpt_oss (transformers' GptOssConfig) biases on
    every projection, attention sinks, the clamped SwiGLU (model.swiglu_limit), biased experts
    and router, model.moe.router topk_softmax with no router losses, head_dim 64, rope_theta
    150000, YaRN (factor 32 over 4096, truncate false), untied (megatronish.config.components)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention (query) heads; divisible by parallel.tp."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); divides n_head and is divisible by parallel.tp.
    Default: n_head (gpt2 always uses n_head)."""
    d_model: int = 128
    """Hidden size; divisible by n_head unless head_dim is set."""
    head_dim: int | None = None
    """Size of one attention head, even (RoPE); llama only. The qkv projection is then
    (n_head + 2 n_kv_head) * head_dim wide and the output projection n_head * head_dim to
    d_model (Qwen3: 16 heads of 128 on d_model 1024). Default: d_model / n_head."""
    d_ff: int | None = None
    """MLP inner size, divisible by parallel.tp. Default: 4 * d_model for gpt2, and for llama
    8/3 * d_model rounded up to a multiple of 256 (the same at every tp)."""
    vocab_size: int | None = None
    """Tokens in the vocabulary. Default: the dataset's vocabulary (from its metadata)."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (size of gpt2's position table)."""
    dropout: float = 0.0
    """Dropout probability on attention probabilities and residual branches. With
    mtp_loss_coef the only model key a resumed run may change (the others must equal the
    checkpoint's)."""
    tie_embeddings: bool | None = None
    """Share the token embedding with the output layer. Default: true for gpt2, false for llama."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base (llama)."""
    rope_local_base_freq: float | None = None
    """RoPE base of the sliding-window blocks, which then rotate without model.rope_scaling
    (Gemma 3's local layers: 1e4); null: every block rotates by rope_theta and rope_scaling."""
    query_pre_attn_scalar: float | None = None
    """The attention scores are scaled by query_pre_attn_scalar^-0.5 (Gemma 3), > 0; null:
    1/sqrt(head_dim)."""
    attn_logit_softcapping: float | None = None
    """Soft-cap of the attention scores, c tanh(score / c) after the scale and before the
    masks (Gemma 2), > 0; null: none."""
    final_logit_softcapping: float | None = None
    """Soft-cap of the output logits, c tanh(logit / c), in training, evaluation and generate
    (Gemma 2), > 0; null: none."""
    partial_rotary_factor: float = 1.0
    """The fraction of each head's dims RoPE rotates (the first head_dim x factor, which must be
    even; the rest pass unrotated), and the frequencies are those of a head of that many dims
    (Qwen3.5: 0.25); 0 < factor <= 1, llama only."""
    rope_scaling: RopeScalingConfig | None = None
    """null: plain RoPE. Otherwise the context extension of the family's config.json
    `rope_scaling` (`type` for its `rope_type`), computed as transformers computes it; llama
    only. Its keys are model.rope_scaling.*, those of its type only; --set takes one key at a
    time or a YAML mapping ("model.rope_scaling={type: yarn, factor: 4, ...}")."""
    swiglu_limit: float = 7.0
    """The clamped SwiGLU's limit (gpt_oss, its dense MLPs and experts): the gate is clamped to
    at most this, the up projection to [-limit, limit]; > 0."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2); llama only (gpt2 has biases
    everywhere). The bias splits over tp with the heads, as the qkv weight's rows."""
    qk_norm: bool = False
    """RMSNorm (eps norm_eps) of each head's query and key over head_dim before RoPE, with one
    learned weight of head_dim for q and one for k shared by all heads (Qwen3); llama only."""
    sliding_window: int | None = None
    """Sliding-window attention (Mistral; Qwen2 and Qwen3 with use_sliding_window): a query at
    position i sees the keys at positions j with i - j < sliding_window, that is itself and the
    sliding_window - 1 before it (as transformers masks it), on top of the causal mask and the
    document masks; positive, not with gpt2. null: every earlier position."""
    full_attention_layers: int = 0
    """With model.sliding_window: the first this-many blocks (by global block index, whatever
    the pipeline layout) attend to every earlier position and the others through the window
    (Qwen2 and Qwen3's max_window_layers; 0, every block slides: Mistral). 0 to model.n_layer."""
    mtp_depth: int = 0
    """Multi-token prediction modules (DeepSeek-V3): module k (1..mtp_depth) combines the
    previous depth's final hidden state with the embedding of the token k positions ahead,
    runs one more transformer block (block n_layer + k - 1: a mixture of experts where
    model.moe's first_k_dense and every make that index one, as in DeepSeek-V3, else dense) and
    the shared output layer, and predicts the token k + 1 ahead. Training only: evaluation and
    generate use the main model. 0: off (DeepSeek-V3: 1); below train.seq_len."""
    mtp_loss_coef: float = 0.3
    """Weight of the multi-token prediction loss (the mean over the depths of their
    cross-entropies) added to the main loss, >= 0 (DeepSeek-V3: 0.3, then 0.1; a resumed run
    may change it)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts MLPs (off by default); see model.moe.*."""
    attention: Literal["mha", "mla"] = "mha"
    """mha: multi-head (grouped-query) attention of n_head heads of head_dim. mla: DeepSeek's
    multi-head latent attention (llama only): n_head heads whose keys and values come from a
    compressed latent of model.mla.kv_lora_rank plus one rotary key shared by all heads; its
    sizes are model.mla.* (head_dim, n_kv_head, qk_norm and qkv_bias unused; model.sliding_window
    masks its heads as it masks mha's)."""
    mla: MLAConfig = field(default_factory=MLAConfig)
    """Multi-head latent attention's sizes (with model.attention mla only); see model.mla.*."""
    layer_types: list[Literal["linear_attention", "full_attention", "sliding_attention"]] | None = (
        None
    )
    """Each block's token mixer, as transformers' configs name them (a list of model.n_layer
    entries): full_attention (model.attention's heads over every earlier position),
    sliding_attention (the same heads through model.sliding_window: Gemma 3's local layers,
    GPT-OSS's alternate ones) or linear_attention (Qwen3.5's Gated DeltaNet: a causal depthwise
    convolution, then the gated delta rule's recurrent state per value head, sized by
    model.linear_*). null: every block model.attention, sliding as model.sliding_window and
    model.full_attention_layers say. Multi-token prediction blocks are full attention."""
    linear_conv_kernel_dim: int = 4
    """Width of linear attention's causal depthwise convolution over q, k and v (>= 1)."""
    linear_key_head_dim: int = 128
    """Size of one linear-attention query and key head (the recurrent state's rows)."""
    linear_value_head_dim: int = 128
    """Size of one linear-attention value head (the recurrent state's columns)."""
    linear_num_key_heads: int = 16
    """Linear-attention query and key heads; divisible by parallel.tp."""
    linear_num_value_heads: int = 32
    """Linear-attention value heads (each with its own state, decay and beta): a multiple of
    linear_num_key_heads (each query-key head serves that many consecutive value heads),
    divisible by parallel.tp."""
    lora: LoraConfig | None = None
    """null: every weight trains. Otherwise low-rank adapters (LoRA) on the projections of
    model.lora.targets, every other weight frozen; see model.lora.*."""

    @property
    def components(self) -> BlockComponents:
        """The components the blocks are built from (megatronish.config.components): the
        family's choice (megatronish.config.presets), with model.attention and model.qkv_bias."""
        return components_of(self.arch, self.attention, self.qkv_bias)

    @property
    def activation_limit(self) -> float | None:
        """The clamped SwiGLU's limit (model.swiglu_limit) where the components clamp, else
        None (plain SwiGLU or GELU)."""
        return self.swiglu_limit if self.components.mlp == "clamped_swiglu" else None

    def block_attention(self, index: int) -> AttentionKind:
        """The attention block `index` (its global index) runs: gated_deltanet where
        model.layer_types says linear_attention, else the components' full attention."""
        types = self.layer_types
        if types is not None and index < len(types) and types[index] == "linear_attention":
            return "gated_deltanet"
        return self.components.attention


# The keys of model.rope_scaling each type reads (besides `type`); a key of another type is an
# error unless left at its default.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}


@dataclass
class RopeScalingConfig:
    type: Literal["linear", "llama3", "yarn"] | None = None
    """linear (every frequency divided by factor: Gemma 3's global layers), llama3 (Llama 3.1+:
    keys factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) or yarn
    (Qwen long context: factor, original_max_position_embeddings and the optional beta_fast,
    beta_slow, attention_factor, mscale, mscale_all_dim, truncate). Required."""
    factor: float | None = None
    """Context extension factor, >= 1. Required."""
    original_max_position_embeddings: int | None = None
    """The context the model was pretrained with. Required but for linear."""
    low_freq_factor: float | None = None
    """llama3 (required): wavelengths longer than original_max_position_embeddings /
    low_freq_factor are slowed by factor."""
    high_freq_factor: float | None = None
    """llama3 (required, > low_freq_factor): wavelengths shorter than
    original_max_position_embeddings / high_freq_factor are kept; those between the two bounds
    are blended linearly in original_max_position_embeddings / wavelength."""
    beta_fast: float = 32.0
    """yarn: dimensions that turn more than beta_fast times over the original context keep their
    frequency (> beta_slow)."""
    beta_slow: float = 1.0
    """yarn: dimensions that turn fewer than beta_slow times (> 0) are slowed by factor; a
    linear ramp between the two."""
    attention_factor: float | None = None
    """yarn: the multiplier of cos and sin (so of the attention logits, squared), > 0. Default:
    0.1 ln(factor) + 1, or with mscale and mscale_all_dim both set and non-zero the ratio of
    0.1 mscale ln(factor) + 1 to 0.1 mscale_all_dim ln(factor) + 1."""
    mscale: float | None = None
    """yarn: see attention_factor (>= 0)."""
    mscale_all_dim: float | None = None
    """yarn: see attention_factor (>= 0)."""
    truncate: bool = True
    """yarn: round the ramp's ends out to whole dimensions."""

    def to_dict(self) -> dict[str, Any]:
        """`type` and the keys its type reads, as the config file and checkpoints write them."""
        keys = ROPE_SCALING_KEYS.get(self.type or "", ())
        return {"type": self.type} | {key: getattr(self, key) for key in keys}
