"""Range checks of single config values, each failing with a UserError that names the key and
what is valid. Checks between values and the world size are in config.derive."""

from __future__ import annotations

from pathlib import Path

from megatronish.config.degrees import with_valid_values
from megatronish.config.lora import check_lora
from megatronish.config.model_checks import (
    check_attention,
    check_layer_types,
    check_partial_rotary,
    check_rope_scaling,
    check_score_options,
)
from megatronish.config.objective_checks import check_objective
from megatronish.config.optim_checks import check_optimizer
from megatronish.config.rules import VALID, DegreeError, divisors, require, require_degree
from megatronish.config.schema import Config, TrainConfig
from megatronish.errors import UserError
from megatronish.paths import require_output_dir


def check_values(cfg: Config) -> None:
    """Ranges of single values; checks between values and the world size are in `derive`. A
    message that suggests values of a key lists those that pass every check here."""
    try:
        value_checks(cfg)
    except DegreeError as exc:
        raise with_valid_values(exc, cfg, value_checks) from None


def value_checks(cfg: Config) -> None:
    """check_values without the suggestions filled in (config.degrees runs it on each)."""
    _check_sizes(cfg)
    _check_ranges(cfg)
    check_moe_values(cfg)
    check_rope_scaling(cfg)
    check_attention(cfg)
    check_layer_types(cfg)
    check_partial_rotary(cfg)
    check_score_options(cfg)
    check_optimizer(cfg)
    check_objective(cfg)
    check_lora(cfg.model.lora, cfg.model.components, cfg.model.moe.num_experts > 0)
    require(
        cfg.checkpoint.init_lora_from is None or cfg.model.lora is not None,
        "checkpoint.init_lora_from: a LoRA adapter needs model.lora (its rank, alpha, targets)",
    )
    _check_fp8_keys(cfg.train)
    observe = cfg.observe
    require(
        observe.straggler_ratio > 1,
        f"observe.straggler_ratio: {observe.straggler_ratio} must be > 1",
    )
    require(
        observe.flight_recorder >= 0,
        f"observe.flight_recorder: {observe.flight_recorder} must be >= 0",
    )
    profile_steps(cfg)
    profile_ranks(cfg)


def _check_sizes(cfg: Config) -> None:
    """The counts and sizes: positive integers (or null where the config may leave one unset)."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    for key, value in [
        ("model.n_layer", model.n_layer),
        ("model.n_head", model.n_head),
        ("model.d_model", model.d_model),
        ("model.max_seq_len", model.max_seq_len),
        ("parallel.tp", parallel.tp),
        ("parallel.pp", parallel.pp),
        ("parallel.pp_virtual", parallel.pp_virtual),
        ("parallel.cp", parallel.cp),
        ("parallel.ep", parallel.ep),
        ("model.moe.top_k", model.moe.top_k),
        ("model.moe.every", model.moe.every),
        ("train.steps", train.steps),
        ("train.micro_batch_size", train.micro_batch_size),
        ("train.global_batch_size", train.global_batch_size),
        ("train.seq_len", train.seq_len),
        ("train.log_every", train.log_every),
        ("train.max_skipped_steps", train.max_skipped_steps),
        ("rl.tokens_per_micro_batch", cfg.rl.tokens_per_micro_batch),
    ]:
        require(value >= 1, f"{key}: {value} is not valid; must be a positive integer")
    for key, value in [
        ("model.n_kv_head", model.n_kv_head),
        ("model.head_dim", model.head_dim),
        ("model.d_ff", model.d_ff),
        ("model.vocab_size", model.vocab_size),
        ("model.moe.d_ff", model.moe.d_ff),
        ("parallel.dp", parallel.dp),
    ]:
        require(value is None or value >= 1, f"{key}: {value} is not valid; must be >= 1 or null")


def _check_ranges(cfg: Config) -> None:
    """The rates, intervals, limits and epsilons, and the sequence and kv heads the model
    allows."""
    model, train = cfg.model, cfg.train
    components = model.components
    require(
        0.0 <= model.dropout < 1.0,
        f"model.dropout: {model.dropout} is not valid; must be in [0, 1)",
    )
    require(model.norm_eps > 0, f"model.norm_eps: {model.norm_eps} must be > 0")
    require(train.lr > 0, f"train.lr: {train.lr} must be > 0")
    require(
        0 <= train.min_lr <= train.lr,
        f"train.min_lr: {train.min_lr} must be in [0, train.lr={train.lr}]",
    )
    require(train.warmup_steps >= 0, f"train.warmup_steps: {train.warmup_steps} must be >= 0")
    require(train.weight_decay >= 0, f"train.weight_decay: {train.weight_decay} must be >= 0")
    require(train.grad_clip >= 0, f"train.grad_clip: {train.grad_clip} must be >= 0 (0 disables)")
    require(train.eval_every >= 0, f"train.eval_every: {train.eval_every} must be >= 0 (0: never)")
    require(train.eval_steps >= 1, f"train.eval_steps: {train.eval_steps} must be >= 1")
    require(cfg.checkpoint.every >= 0, f"checkpoint.every: {cfg.checkpoint.every} must be >= 0")
    require(cfg.checkpoint.keep >= 0, f"checkpoint.keep: {cfg.checkpoint.keep} must be >= 0")
    timeout_s = cfg.parallel.timeout_s
    require(timeout_s > 0, f"parallel.timeout_s: {timeout_s} must be > 0")
    require(cfg.optim.bucket_mb > 0, f"optim.bucket_mb: {cfg.optim.bucket_mb} must be > 0")
    require(
        0 < cfg.optim.beta1 < 1 and 0 < cfg.optim.beta2 < 1,
        "optim.beta1 and optim.beta2 must be in (0, 1)",
    )
    require(
        train.seq_len <= model.max_seq_len,
        f"train.seq_len: {train.seq_len} is longer than model.max_seq_len={model.max_seq_len}",
    )
    require(
        components.rope or model.n_kv_head in (None, model.n_head),
        f"model.n_kv_head: gpt2 uses n_kv_head = n_head = {model.n_head}; got {model.n_kv_head}",
    )
    require(
        components.rope or model.head_dim is None,
        f"model.head_dim: gpt2 uses d_model / n_head; got {model.head_dim} (only with RoPE "
        "families)",
    )
    require(
        not components.linear_bias or not model.qkv_bias,
        "model.qkv_bias: gpt2 already has biases on every projection (only with RoPE families)",
    )
    require(
        components.rope or not model.qk_norm,
        "model.qk_norm: gpt2 has no norm of queries and keys (only with RoPE families)",
    )
    require(
        model.swiglu_limit > 0,
        f"model.swiglu_limit: {model.swiglu_limit} is not valid; must be > 0 (gpt_oss: 7.0)",
    )
    _check_sliding_window(cfg)
    _check_mtp(cfg)


def _check_fp8_keys(train: TrainConfig) -> None:
    """train.fp8_recipe and train.fp8_high_precision only with train.precision fp8: a value other
    than the default (as a model.mla size other than null needs model.attention mla) under
    another precision would do nothing."""
    defaults = TrainConfig()
    for key in ("fp8_recipe", "fp8_high_precision"):
        value, default = getattr(train, key), getattr(defaults, key)
        require(
            train.precision == "fp8" or value == default,
            f"train.{key}: {value} needs train.precision=fp8 (train.precision is "
            f"{train.precision}); set train.precision=fp8 or leave train.{key} unset "
            f"(valid with {train.precision}: {default}, the default)",
        )


def _check_mtp(cfg: Config) -> None:
    """model.mtp_depth and model.mtp_loss_coef."""
    model, seq_len = cfg.model, cfg.train.seq_len
    require(
        0 <= model.mtp_depth < seq_len,
        f"model.mtp_depth: {model.mtp_depth} is not valid; must be 0 (off) to train.seq_len - 1 "
        f"= {seq_len - 1}",
    )
    require(
        model.mtp_loss_coef >= 0,
        f"model.mtp_loss_coef: {model.mtp_loss_coef} is not valid; must be >= 0",
    )


def _check_sliding_window(cfg: Config) -> None:
    """model.sliding_window and model.full_attention_layers, the pattern of the blocks that
    slide."""
    model = cfg.model
    window, full = model.sliding_window, model.full_attention_layers
    require(
        window is None or window >= 1,
        f"model.sliding_window: {window} is not valid; must be a positive integer (the "
        "positions a query sees, itself included) or null",
    )
    require(
        model.components.rope or window is None,
        f"model.sliding_window: gpt2 attends to every earlier position; got {window} (set it "
        "only for llama)",
    )
    require(
        0 <= full <= model.n_layer,
        f"model.full_attention_layers: {full} is not valid; must be 0 to model.n_layer="
        f"{model.n_layer}",
    )
    require(
        full == 0 or window is not None,
        f"model.full_attention_layers: {full} needs model.sliding_window (the blocks after the "
        "first full_attention_layers slide); set model.sliding_window or "
        "model.full_attention_layers=0",
    )


def check_moe_values(cfg: Config) -> None:
    """The model.moe values on their own, and whether parallel.ep has experts to split (whether
    it divides them: derive, which knows the data-parallel degree ep splits too)."""
    moe, ep = cfg.model.moe, cfg.parallel.ep
    require(
        moe.num_experts >= 0,
        f"model.moe.num_experts: {moe.num_experts} is not valid; 0 (dense) or a positive integer",
    )
    require(
        ep == 1 or moe.num_experts > 0,
        f"parallel.ep: {ep} needs experts to split; set model.moe.num_experts (a multiple of "
        f"{ep}) or parallel.ep=1",
    )
    if moe.num_experts == 0:
        return
    require(
        cfg.model.components.mlp in ("swiglu", "clamped_swiglu"),
        f"model.moe: experts are SwiGLU; model.arch '{cfg.model.arch}' has "
        f"{cfg.model.components.mlp} MLPs; set model.arch to a SwiGLU family (llama, qwen3_moe, "
        "...) or model.moe.num_experts=0",
    )
    require(
        not cfg.model.components.biased_experts or cfg.model.d_model % cfg.parallel.tp == 0,
        f"model.d_model: {cfg.model.d_model} is not divisible by parallel.tp={cfg.parallel.tp} "
        "(the experts' down biases split over tp)",
    )
    require(
        moe.top_k <= moe.num_experts,
        f"model.moe.top_k: {moe.top_k} is more than model.moe.num_experts={moe.num_experts}; "
        f"valid: 1 to {moe.num_experts}",
    )
    for key, value in (("aux_loss_coef", moe.aux_loss_coef), ("z_loss_coef", moe.z_loss_coef)):
        require(value >= 0, f"model.moe.{key}: {value} must be >= 0 (0 turns it off)")
    require(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor: {moe.capacity_factor} must be > 0, or null (dropless)",
    )
    require(
        not moe.shared_expert_gate or moe.shared_expert or moe.n_shared_experts > 0,
        "model.moe.shared_expert_gate: true gates the shared experts, and there are none; set "
        "model.moe.shared_expert=true or model.moe.shared_expert_gate=false",
    )
    check_deepseek_moe(cfg)


def check_deepseek_moe(cfg: Config) -> None:
    """The DeepSeek MoE keys: groups, bias balancing, sequence loss, shared and dense blocks."""
    moe, n_layer = cfg.model.moe, cfg.model.n_layer
    for key in ("bias_update_speed", "seq_aux_loss_coef", "n_shared_experts", "first_k_dense"):
        value = getattr(moe, key)
        require(value >= 0, f"model.moe.{key}: {value} must be >= 0 (0 turns it off)")
    require(
        not (moe.shared_expert and moe.n_shared_experts > 0),
        f"model.moe.shared_expert: true and model.moe.n_shared_experts={moe.n_shared_experts} "
        "both ask for shared experts; set only n_shared_experts",
    )
    require(
        any(i % moe.every == 0 for i in range(moe.first_k_dense, n_layer)),
        f"model.moe.first_k_dense: {moe.first_k_dense} leaves no MoE block of model.n_layer="
        f"{n_layer} with model.moe.every={moe.every}; valid: 0 to "
        f"{(n_layer - 1) // moe.every * moe.every}",
    )
    sigmoid = moe.router == "sigmoid"
    for key, value, default in (
        ("n_group", moe.n_group, 1),
        ("topk_group", moe.topk_group, 1),
        ("routed_scaling_factor", moe.routed_scaling_factor, 1.0),
        ("bias_update_speed", moe.bias_update_speed, 0.0),
    ):
        require(
            sigmoid or value == default,
            f"model.moe.{key}: {value} needs model.moe.router=sigmoid (router is "
            f"{moe.router!r}); valid otherwise: {default}",
        )
    require(
        moe.routed_scaling_factor > 0,
        f"model.moe.routed_scaling_factor: {moe.routed_scaling_factor} must be > 0",
    )
    require_degree(
        moe.n_group >= 1 and moe.num_experts % moe.n_group == 0,
        f"model.moe.n_group: {moe.n_group} does not divide model.moe.num_experts="
        f"{moe.num_experts}; valid: {VALID}",
        "model.moe.n_group",
        divisors(moe.num_experts),
    )
    per_group = moe.num_experts // moe.n_group
    require_degree(
        moe.n_group == 1 or per_group >= 2,
        f"model.moe.n_group: {moe.n_group} leaves one expert per group (groups are ranked by "
        f"their two best scores); valid: {VALID}",
        "model.moe.n_group",
        divisors(moe.num_experts),
    )
    require(
        1 <= moe.topk_group <= moe.n_group,
        f"model.moe.topk_group: {moe.topk_group} is not valid; 1 to model.moe.n_group="
        f"{moe.n_group}",
    )
    require(
        moe.topk_group * per_group >= moe.top_k,
        f"model.moe.top_k: {moe.top_k} is more than the {moe.topk_group * per_group} experts of "
        f"the model.moe.topk_group={moe.topk_group} chosen groups ({per_group} each); valid: "
        f"topk_group >= {-(-moe.top_k // per_group)} or top_k <= {moe.topk_group * per_group}",
    )


def profile_steps(cfg: Config) -> tuple[int, int] | None:
    """observe.profile_steps as (first, last) step, both included; None when unset."""
    spec = cfg.observe.profile_steps
    if spec is None:
        return None
    first, _, last = str(spec).partition(":")
    try:
        steps = (int(first), int(last or first))
    except ValueError:
        steps = (0, 0)
    require(
        1 <= steps[0] <= steps[1],
        f'observe.profile_steps: {spec!r} is not valid; expected "A:B" with 1 <= A <= B '
        '(steps, both included), e.g. "5:7"',
    )
    return steps


def profile_ranks(cfg: Config) -> frozenset[int] | None:
    """observe.profile_ranks as a set of global ranks; None for all."""
    spec = str(cfg.observe.profile_ranks).strip()
    if spec == "all":
        return None
    try:
        ranks = frozenset(int(part) for part in spec.split(","))
    except ValueError:
        ranks = frozenset([-1])
    require(
        all(r >= 0 for r in ranks),
        f"observe.profile_ranks: {spec!r} is not valid; expected all, or comma-separated "
        'global ranks such as "0,3"',
    )
    return ranks


def check_dataset_vocab(cfg: Config, data_vocab: int, dataset: str | Path) -> None:
    """model.vocab_size, when set, must hold every token id of the dataset."""
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < data_vocab:
        raise UserError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the vocabulary of the "
            f"dataset {dataset} ({data_vocab}); set at least {data_vocab}, or null to take the "
            "dataset's (--set model.vocab_size=null)"
        )


def check_output_paths(cfg: Config) -> None:
    """run.out_dir, and checkpoint.dir when the run saves (default <run.out_dir>/checkpoints),
    must be directories or places where they can be made: UserError naming the key otherwise."""
    out_dir = require_output_dir(cfg.run.out_dir, "run.out_dir")
    if cfg.checkpoint.save:
        if cfg.checkpoint.dir:
            require_output_dir(cfg.checkpoint.dir, "checkpoint.dir")
        else:
            require_output_dir(out_dir / "checkpoints", "checkpoint.dir (default)")
