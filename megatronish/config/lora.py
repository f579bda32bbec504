"""model.lora (LoraConfig): low-rank adapters on the blocks' linear layers, the base frozen, and
its checks, each failing with a UserError that names the key and what is valid."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronish.config.components import BlockComponents
from megatronish.config.rules import require

# The projections an adapter may target, as Hugging Face (and peft) name them.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# The fused experts' weights as peft targets them (LoraConfig.target_parameters, transformers 5's
# Mixtral and Qwen3-MoE experts): one adapter over each expert's gate and up, one over its down.
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS + EXPERT_TARGETS


@dataclass
class LoraConfig:
    rank: int = 8
    """r, the adapters' inner size (> 0)."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (> 0)."""
    dropout: float = 0.0
    """Dropout probability on the adapters' input (0 <= dropout < 1)."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """The projections that get an adapter, as Hugging Face names them: q_proj, k_proj, v_proj,
    o_proj, gate_proj, up_proj, down_proj (q, k and v each get their own adapter, also where
    the base projection is fused), and in a model with experts experts.gate_up_proj and
    experts.down_proj (peft's target_parameters: per expert one adapter over gate and up, one
    over down). Every other weight is frozen."""


def check_lora(lora: LoraConfig | None, components: BlockComponents, experts: bool) -> None:
    """model.lora: a llama-style family (gpt2 names its projections otherwise), its sizes in
    range and its targets projections the model adapts as peft does: the dense attention's (not
    a query projection that also gives output gates, nor latent attention's), the dense
    gated MLP's (not in a model with experts: peft's targets would take the experts' too) and
    the experts' (SwiGLU experts without biases, no dropout: peft adapts them without)."""
    if lora is None:
        return
    key = "model.lora"
    require(
        components.positions == "rope",
        f"{key}: gpt2's projections are c_attn, c_proj and c_fc; LoRA takes the llama-style "
        "families (llama, mistral, qwen2, qwen3 ...)",
    )
    require(lora.rank > 0, f"{key}.rank: {lora.rank} is not valid; must be > 0")
    require(lora.alpha > 0, f"{key}.alpha: {lora.alpha} is not valid; must be > 0")
    require(0 <= lora.dropout < 1, f"{key}.dropout: {lora.dropout} is not valid; must be in [0, 1)")
    require(lora.targets, f"{key}.targets: empty; valid: {', '.join(TARGETS)}")
    valid = ", ".join(TARGETS)
    for target in lora.targets:
        require(target in TARGETS, f"{key}.targets: unknown {target!r}; valid: {valid}")
    lacks = []
    if components.attention != "mha":
        lacks += ATTENTION_TARGETS
    if components.attention_gate:
        lacks += ("q_proj",)
    if experts or not components.gated_mlp:
        lacks += MLP_TARGETS
    if not experts or components.biased_experts:
        lacks += EXPERT_TARGETS
    for target in lora.targets:
        require(
            target not in lacks,
            f"{key}.targets: {target} is not a projection LoRA adapts in this model; valid: "
            + ", ".join(t for t in TARGETS if t not in lacks),
        )
    adapted = set(lora.targets) & set(EXPERT_TARGETS)
    require(
        not (adapted and lora.dropout),
        f"{key}.dropout: {lora.dropout} with targets {', '.join(sorted(adapted))}; the experts' "
        "adapters take no dropout (as peft's): set 0",
    )
