"""The MoE training runs' settings (tests/moe/test_moe_training.py; other tests train MOE and
DEEPSEEK too): the model overrides and the layouts of the two- and four-rank runs."""

# Two blocks, both MoE; the pipeline run mixes dense and MoE blocks (4 blocks, every 2).
MOE = [
    "model.arch=llama", "model.n_kv_head=2", "model.n_layer=2", "model.moe.num_experts=4",
    "model.moe.top_k=2", "model.moe.every=1", "model.moe.d_ff=48", "model.moe.z_loss_coef=0.01",
]  # fmt: skip
CAPACITY = ["model.moe.capacity_factor=1.0"]
# DeepSeek-V3: multi-head latent attention (the deepseek_v3 preset's YaRN), a dense first block,
# then MoE blocks of 8 experts in 4 groups (2 chosen), a sigmoid router with routing biases
# moved every step, the sequence-wise balancing loss and two shared experts, and a multi-token
# prediction module whose block is a MoE block (block 2: its router's bias balanced too).
DEEPSEEK = [
    "model.arch=deepseek_v3", "model.mla.q_lora_rank=12", "model.mla.kv_lora_rank=16",
    "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6",
    "model.n_layer=2", "model.moe.num_experts=8",
    "model.moe.top_k=2", "model.moe.d_ff=16", "model.moe.router=sigmoid", "model.moe.n_group=4",
    "model.moe.topk_group=2", "model.moe.routed_scaling_factor=1.5",
    "model.moe.bias_update_speed=0.01", "model.moe.seq_aux_loss_coef=0.01",
    "model.moe.aux_loss_coef=0", "model.moe.n_shared_experts=2", "model.moe.first_k_dense=1",
    "model.mtp_depth=1",
]  # fmt: skip
# GPT-OSS: sinks, biased attention and experts behind the clamped SwiGLU (a limit that binds),
# the router's logit bias, top 2 of 4 softmaxed, a sliding block then a full one.
GPT_OSS = [
    "model.arch=gpt_oss", "model.n_kv_head=2", "model.head_dim=8", "model.n_layer=2",
    "model.sliding_window=4", "model.layer_types=[sliding_attention, full_attention]",
    "model.swiglu_limit=0.5", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_ff=24",
]  # fmt: skip
SP, FULL = ["parallel.sequence_parallel=true"], ["train.activation_checkpointing=full"]
# fp8 experts with fp32 around them, a few steps: later steps are not held to 1e-5 (an fp32
# rounding that moves a value across an fp8 rounding boundary changes its cast by a whole fp8
# step; tests/commands/test_bench.py holds the dense layers to their first step likewise).
FP8_STEPS = 2
FP8 = ["train.precision=fp8", "train.fp8_high_precision=fp32", f"train.steps={FP8_STEPS}"]
TENSORWISE, ROWWISE = ["train.fp8_recipe=tensorwise"], ["train.fp8_recipe=rowwise"]
BLOCKWISE, SHARED = ["train.fp8_recipe=blockwise"], ["model.moe.shared_expert=true"]
# LoRA on q_proj and the experts (their adapters split over ep and tp), the base frozen.
LORA = [
    "model.lora.rank=4", "model.lora.alpha=8", "train.lr=0.02",
    "model.lora.targets=[q_proj, experts.gate_up_proj, experts.down_proj]",
]  # fmt: skip
# name -> (tp, cp, dp, pp, ep, overrides); the reference of each is its overrides at one rank.
TWO_RANKS = {
    "ep2": (1, 1, 2, 1, 2, MOE),
    "dp2 ep1": (1, 1, 2, 1, 1, MOE),
    "ep2 capacity": (1, 1, 2, 1, 2, MOE + CAPACITY),
    "ep2 shared expert topk_softmax": (
        1, 1, 2, 1, 2, MOE + ["model.moe.shared_expert=true", "model.moe.router=topk_softmax"],
    ),
    "ep2 deepseek full recompute": (1, 1, 2, 1, 2, DEEPSEEK + FULL),
    "ep2 fp8 tensorwise": (1, 1, 2, 1, 2, MOE + FP8 + TENSORWISE),
    "ep2 fp8 rowwise shared expert": (1, 1, 2, 1, 2, MOE + FP8 + ROWWISE + SHARED),
    "ep2 fp8 blockwise capacity": (1, 1, 2, 1, 2, MOE + CAPACITY + FP8 + BLOCKWISE),
    "ep2 fp8 rowwise gpt_oss": (1, 1, 2, 1, 2, GPT_OSS + FP8 + ROWWISE),
    "ep2 lora experts": (1, 1, 2, 1, 2, MOE + LORA),
}  # fmt: skip
FOUR_RANKS = {
    "ep2 tp2": (2, 1, 2, 1, 2, MOE),
    "ep2 tp2 sequence parallel capacity": (
        2,
        1,
        2,
        1,
        2,
        MOE + CAPACITY + ["parallel.sequence_parallel=true"],
    ),
    "ep2 pp2 dense and moe blocks": (1, 1, 2, 2, 2, MOE + ["model.n_layer=4", "model.moe.every=2"]),
    "ep2 cp2": (1, 2, 2, 1, 2, MOE),
    "ep2 tp2 sequence parallel deepseek": (2, 1, 2, 1, 2, DEEPSEEK + SP),
    "pp2 cp2 deepseek zero1": (1, 2, 1, 2, 1, DEEPSEEK + ["optim.zero=1"]),
    "dp4 ep2 zero1": (1, 1, 4, 1, 2, MOE + ["optim.zero=1"]),
    "ep2 tp2 sequence parallel fp8 tensorwise shared expert": (
        2, 1, 2, 1, 2, MOE + SP + FP8 + TENSORWISE + SHARED,
    ),
    "ep2 tp2 sequence parallel fp8 rowwise": (2, 1, 2, 1, 2, MOE + SP + FP8 + ROWWISE),
    "ep2 cp2 fp8 tensorwise": (1, 2, 2, 1, 2, MOE + FP8 + TENSORWISE),
    "ep2 tp2 sequence parallel zero3 lora experts": (
        2, 1, 2, 1, 2, MOE + SP + LORA + ["optim.zero=3"],
    ),
    "dp4 ep2 zero3 lora experts": (1, 1, 4, 1, 2, MOE + LORA + ["optim.zero=3"]),
}  # fmt: skip
