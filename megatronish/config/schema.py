"""The config schema: one typed dataclass per section, every key of CONTRACT.md a field
documented where it is declared (scripts/config_reference.py prints the reference in
docs/config.md from these docstrings). Loading is in config.load, range checks in
config.checks, sizes that follow from the values in config.derive. The model section's
dataclasses live in config.model_schema."""

from __future__ import annotations

import dataclasses
import keyword
from dataclasses import dataclass, field
from typing import Any, Literal

from megatronish.config.model_schema import (  # noqa: F401 (the schema's names)
    ROPE_SCALING_KEYS,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
)


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer's weights (adjacent ranks)."""
    dp: int | None = None
    """Data-parallel degree. Default: world size / (tp * cp * pp)."""
    cp: int = 1
    """Context-parallel degree: ranks that split every sequence (two zigzag chunks each, ring
    attention between them). train.seq_len must be divisible by 2 * cp."""
    ep: int = 1
    """Expert-parallel degree: the experts of every MoE layer are split into ep contiguous
    blocks over ep data-parallel ranks (adjacent dp ranks; ep divides parallel.dp), which
    exchange tokens by all-to-all. Needs model.moe.num_experts > 0."""
    pp: int = 1
    """Pipeline-parallel degree: stages that split the transformer layers (embedding on the
    first stage, the output layer and loss on the last)."""
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule over the gradient-accumulation micro-batches: 1f1b (one forward, one
    backward; a stage holds at most pp micro-batches of activations) or gpipe (every forward,
    then every backward; holds all of them)."""
    pp_layers: str | None = None
    """Transformer layers per pipeline stage, comma-separated (e.g. "3,2"), summing to
    model.n_layer. Default: as even as possible, earlier stages taking the remainder. With
    pp_virtual > 1: layers per model chunk, pp x pp_virtual numbers."""
    pp_virtual: int = 1
    """Model chunks per pipeline rank (interleaved schedule, Megatron's virtual pipeline): the
    layers are cut into pp x pp_virtual chunks and rank r holds chunks r, r + pp, ...; the
    bubble shrinks to (pp - 1) / (pp_virtual x m) for m micro-batches per step, which must then
    be a multiple of pp. Has no effect at pp = 1."""
    sequence_parallel: bool = False
    """Split the activations between blocks along the sequence over the tp ranks (Megatron's
    sequence parallelism: all-gather / reduce-scatter instead of all-reduce)."""
    tp_comm_overlap: bool = False
    """Hide tensor-parallel communication under the GEMMs (Megatron-LM's --tp-comm-overlap).
    With sequence_parallel the all-gather before each column-parallel GEMM and the
    reduce-scatter after each row-parallel one (and their backward mirrors) run as tp
    point-to-point ring steps, each under the GEMM of one sequence chunk; without it the
    row-parallel all-reduce runs in tp chunks along the sequence, each under the next chunk's
    GEMM (train.seq_len / parallel.cp must then divide by parallel.tp). Losses equal those
    without it to fp32 rounding. No effect at tp = 1."""
    timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the run fails instead of hanging
    (joining the process group at the start waits for every rank at least 300 s)."""


@dataclass
class TrainConfig:
    seed: int = 1234
    """Seed of the weights, the data order and dropout; the same at every parallel layout."""
    steps: int = 100
    """Optimizer steps to run."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass on one data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks; a multiple of
    micro_batch_size * dp (the quotient is the number of gradient accumulation steps)."""
    seq_len: int = 128
    """Tokens per training sequence; at most model.max_seq_len."""
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to biases and norm weights)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    max_skipped_steps: int = 5
    """A step whose loss or gradient norm is not finite (NaN or inf, on any rank) is skipped: no
    optimizer update, a `skipped` line in metrics.jsonl. After this many skipped in a row the
    run stops with exit status 1."""
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"
    """fp32; bf16 autocast with fp32 weights, gradients and optimizer state; or fp8: the
    transformer blocks' linear GEMMs (attention qkv and output, the Gated DeltaNet blocks'
    projections, the dense MLPs, the MoE layers' routed and shared experts) in fp8 by
    train.fp8_recipe (emulated on CPU), everything else in train.fp8_high_precision."""
    fp8_recipe: Literal["tensorwise", "rowwise", "blockwise"] = "tensorwise"
    """With train.precision fp8, how the GEMM operands are scaled: tensorwise (one scale per
    tensor; e4m3 inputs and weights, e5m2 output gradients), rowwise (a scale per row along the
    summed dimension, powers of two, e4m3), blockwise (DeepSeek-V3: 1 x 128 tiles of
    activations and gradients, 128 x 128 weight blocks, e4m3; at tp > 1 each rank's share of a
    split dimension must be a multiple of 128; not with experts at parallel.cp > 1)."""
    fp8_high_precision: Literal["bf16", "fp32"] = "bf16"
    """With train.precision fp8, the precision of what fp8 leaves out (embeddings, the output
    layer and loss, norms, the attention core, MoE routers, the fp8 GEMMs' outputs): bf16
    autocast, as Megatron and DeepSeek train, or fp32 (no autocast, as torchao's Float8Linear
    computes in an fp32 model; a step at any tp degree computes what tp 1 does to fp32
    rounding). Weights, gradients and the optimizer are fp32 either way."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """none; selective: recompute the attention core in backward; full: recompute each block."""
    log_every: int = 1
    """Write a metrics line (and update the progress bar) every this many steps."""
    eval_every: int = 50
    """Compute the validation loss every this many steps (and at the last step); 0: never."""
    eval_steps: int = 4
    """Global batches of the validation split per evaluation."""
    objective: Literal["lm", "dpo"] = "lm"
    """lm: next-token prediction (with multi-token prediction where model.mtp_depth > 0);
    dpo: Direct Preference Optimization on a dataset from `prepare --preference` (train.dpo;
    train.global_batch_size and micro_batch_size then count pairs)."""
    dpo: DPOConfig | None = None
    """DPO's settings (only with train.objective dpo; null: the defaults below)."""

    @property
    def bf16_autocast(self) -> bool:
        """Whether the forward runs under bf16 autocast: bf16, and fp8 with bf16 as its high
        precision (activations in bf16)."""
        if self.precision == "fp8":
            return self.fp8_high_precision == "bf16"
        return self.precision == "bf16"


@dataclass
class DPOConfig:
    beta: float = 0.1
    """The strength of the pull towards the reference model (the initial weights), > 0."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: the DPO paper's -log sigmoid(beta * margin); ipo: (margin - 1 / (2 beta))^2 on
    the log-ratios averaged over each response's tokens, as trl computes it."""
    label_smoothing: float = 0.0
    """sigmoid only: the share of pairs assumed flipped (conservative DPO), in [0, 0.5)."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw; or muon: Muon (optim.muon) updates every 2-D weight matrix inside the blocks
    (fused q, k, v taken apart; each expert's matrices; the multi-token prediction modules'),
    AdamW (optim.beta1, beta2, eps) the rest: embeddings, the output layer, norms, biases and
    routers. train.lr and its schedule drive both; train.weight_decay is decoupled in both."""
    muon: MuonConfig | None = None
    """Muon's settings (only with optim.name muon; null: the defaults below)."""
    zero: Literal[0, 1, 2, 3] = 0
    """0: every data-parallel rank holds the whole optimizer state; 1: the state is sharded
    across data-parallel ranks (ZeRO stage 1: gradients reduce-scattered, each rank updates
    its block, parameters all-gathered); 2: the gradients too (each bucket reduce-scattered
    after every micro-batch's backward, only this rank's block kept); 3: the parameters too
    (each module's buckets all-gathered before its forward and again before its backward,
    freed after; at pp > 1 kept from their first use to the step's end)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    bucket_mb: float = 25.0
    """Size of the gradient-reduction buckets (MB of fp32 gradients), in the reverse order of
    the parameters."""
    overlap_grad_reduce: bool = True
    """Start each bucket's data-parallel reduction during the step's last backward, as soon as
    its gradients are ready, and with ZeRO-1 each bucket's parameter all-gather after the step,
    waited for by the next forward where it first needs them (false: all of them after
    backward and after the step; with ZeRO-2 and 3 each reduce-scatter and gather
    synchronous where it is issued)."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype the data-parallel gradient reduction travels in (the all-reduce at ZeRO-0,
    the reduce-scatters at ZeRO-1 to 3, over the dp x cp group and the experts' group). bf16,
    as Megatron's --grad-reduce-in-bf16: each bucket's fp32 gradients are divided by dp x cp,
    rounded to bf16, reduced in bf16 and the result written back into the fp32 gradients, so
    half the bytes cross the network and each reduced gradient carries one more bf16
    rounding (2^-8 relative of its ranks' magnitudes). Micro-batches still accumulate in fp32
    (Megatron accumulates in bf16 too); ZeRO-2 and 3 reduce every micro-batch, so there the
    sum over micro-batches adds bf16-rounded parts. Allowed with any train.precision (with
    fp32 training it trades the gradients' last bits for half the traffic). The tensor-parallel
    sum of sequence-parallel replicated parameters, the tied embedding's sum over the
    pipeline's ends, the loss and the gradient norm stay fp32."""
    zero3_prefetch: bool = True
    """With optim.zero = 3 and the overlap: start the all-gather of the next module's
    parameters when a module's own are ready (its forward, or its backward), so the gather
    runs under that module's compute; false holds one module's parameters less at a time."""


@dataclass
class MuonConfig:
    momentum: float = 0.95
    """Muon's momentum mu (torch.optim.Muon's arithmetic: B <- B + (1 - mu)(g - B))."""
    nesterov: bool = True
    """Orthogonalize g + mu (B - g) instead of B."""
    ns_steps: int = 5
    """Newton-Schulz iterations, in (0, 100)."""
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    """The quintic Newton-Schulz iteration's (a, b, c): three numbers."""
    eps: float = 1e-7
    """The floor of the norm each matrix is divided by before Newton-Schulz."""
    lr_adjust: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """How a matrix's lr is scaled by its shape (A, B), as torch.optim.Muon's adjust_lr_fn:
    match_rms_adamw 0.2 sqrt(max(A, B)) (Moonlight: AdamW's lr and weight decay carry over),
    original sqrt(max(1, A / B))."""
    qk_clip_tau: float | None = None
    """MuonClip's logit bound tau (null: off; > 0): after each step, every attention head whose
    largest pre-softmax logit of the step exceeded tau has its query and key weights scaled
    down to bring it to tau (docs/training.md: QK-clip). Not with model.qk_norm (the norm
    undoes the scaling); metrics.jsonl logs max_attn_logit."""


@dataclass
class DataConfig:
    path: str | None = None
    """A directory written by `megatronish prepare`, or a Megatron indexed dataset read in place
    (PREFIX, PREFIX.idx or PREFIX.bin; it needs model.vocab_size and data.eod_id). Default: the
    built-in corpus (the Python standard library's source), prepared on first use into a cache
    directory."""
    blend: str | list | None = None
    """Datasets mixed by sampling proportion, instead of data.path: Megatron's "0.3 PATH_A 0.7
    PATH_B" or a YAML list of {path, weight}. Weights are positive and normalized; each
    dataset's share of the samples follows its weight, whatever its size. The datasets must
    share a tokenizer."""
    split: str | None = None
    """Ratios "969,30,1": train, validation and test shares of the documents of a dataset
    without a split of its own (a Megatron prefix), in contiguous runs as Megatron splits.
    Default: every document trains. A directory from `prepare` keeps its own split."""
    eod_id: int | None = None
    """The end-of-document token id of a Megatron prefix (a prepared directory records its
    own)."""
    document_mask: bool = False
    """Attention never crosses an end-of-document token, and positions (learned or RoPE)
    restart at each document, as Megatron's reset_attention_mask and reset_position_ids: each
    document of a packed sequence is computed as if it were alone. Always on for SFT data,
    whose documents are its records (a chat template may write that token inside one)."""
    eod_mask_loss: bool = False
    """As Megatron's --eod-mask-loss: the position whose input is the end-of-document token
    (its target, the next document's first token, has nothing of its document to go on) does
    not count in the loss, in training and validation. The loss is then the mean over the
    counted tokens of the whole global batch, as with an SFT loss mask."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go. Default: <run.out_dir>/checkpoints."""
    every: int = 0
    """Save every this many steps (and at the end of the run); 0: only at the end."""
    keep: int = 2
    """Newest checkpoints to keep; older ones are deleted. 0 keeps all."""
    resume: str = "auto"
    """auto: continue from the newest checkpoint in checkpoint.dir if there is one; never;
    or the path of a checkpoint to continue from."""
    save: bool = True
    """Write checkpoints at all."""
    reset_optimizer: bool = False
    """Resume the weights (and the data position and RNG) with a fresh optimizer state: the
    way to continue a checkpoint under another optim.name (without it, a resume whose optim.name
    differs from the checkpoint's is an error)."""
    init_from_hf: str | None = None
    """A Hugging Face model directory (config.json + model.safetensors) to start from."""
    init_lora_from: str | None = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, peft's names)
    whose adapters a fresh model.lora run starts from (its r, lora_alpha and target_modules
    those of model.lora)."""
    async_: bool = False
    """Save in the background (the key is `async`): training waits only while the state is
    copied (to pinned host memory on a GPU, a private copy on a CPU, kept for the next save);
    a writer thread writes this rank's files, and the save is complete (renamed into place,
    `latest`, pruning, "saved" printed) at the first step end where every rank's files are on
    disk. At most one save in flight: the next save, a stop and the end of the run wait for
    it. Until complete it is a temporary directory that resume never takes."""


@dataclass
class KernelsConfig:
    backend: Literal["auto", "triton", "torch"] = "auto"
    """auto: Triton kernels on CUDA (attention on torch for a head dim other than 16, 32, 64
    or 128, the gated delta rule for linear head dims other than those), torch ops elsewhere;
    triton (those head dims only, model.linear_key_head_dim and linear_value_head_dim too);
    torch."""


@dataclass
class ObserveConfig:
    phase_times: bool = True
    """Time every step's phases on every rank (data, forward, backward, gradient sync,
    optimizer, and the wait inside tp, cp, dp and pp communication) and write their min /
    median / max over the ranks to metrics.jsonl on each logged step."""
    straggler_ratio: float = 1.2
    """Rank 0 names a rank whose compute time (step time less communication wait) is more than
    this times the median of the ranks'."""
    profile_steps: str | None = None
    """"A:B": record torch.profiler traces of steps A to B (inclusive) into
    <run.out_dir>/traces/rank_R.json.gz; `megatronish trace` merges them."""
    profile_ranks: str = "all"
    """The ranks that record traces: all, or comma-separated global ranks ("0,3")."""
    tensorboard: bool = False
    """Write every metrics.jsonl scalar to <run.out_dir>/tb (needs the tensorboard package)."""
    flight_recorder: int = 2000
    """Collectives and point-to-point operations each rank remembers for a hang report
    (<run.out_dir>/debug/rank_R.json, written on a timeout or SIGUSR2); 0 turns it off."""


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    """Where metrics.jsonl, the resolved config and (by default) checkpoints go."""


@dataclass
class RLConfig:
    tokens_per_micro_batch: int = 4096
    """The token budget of a micro-batch of the RL backend (megatronish.rl.Policy): its
    variable-length sequences are packed, whole, into micro-batches of at most this many tokens
    (a longer sequence alone in one), with document masks and no padding."""
    # `megatronish rl`, the built-in GRPO run (megatronish.rl.grpo); train.steps its GRPO steps
    sft_steps: int = 0
    """Supervised steps on right answers before GRPO."""
    sft_lr: float | None = None
    """The learning rate of the supervised steps (None: train.lr's)."""
    prompts_per_step: int = 8
    """Problems a step (SFT: examples a step)."""
    num_generations: int = 8
    """Completions sampled per prompt (trl's name); their rewards are normalized as a group."""
    max_completion_length: int = 4
    """Tokens a completion may have before it is cut (trl's name)."""
    temperature: float = 1.0
    """The sampling temperature of the rollouts."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    run: RunConfig = field(default_factory=RunConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config by its keys (a field named after a Python keyword, `async_`, as the key
        `async`)."""
        data = _keys(dataclasses.asdict(self))
        if self.model.rope_scaling is not None:  # only the keys of its type
            data["model"]["rope_scaling"] = self.model.rope_scaling.to_dict()
        return data


def key_of(field_name: str) -> str:
    """The config key of a field: its name, less the `_` that a Python keyword takes as a name
    (the field `async_` is the key `async`)."""
    bare = field_name[:-1]
    return bare if field_name.endswith("_") and keyword.iskeyword(bare) else field_name


def _keys(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    return {key_of(name): _keys(value) for name, value in data.items()}
