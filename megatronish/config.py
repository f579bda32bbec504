"""Typed, strict configuration: YAML and `--set key=value` into dataclasses, validated once.

Every key of CONTRACT.md is a field below, documented where it is declared. An unknown key is
an error that suggests the nearest valid key; a value of the wrong type or out of range names
the key and what is allowed. Sizes that follow from others (data-parallel degree, gradient
accumulation, padded vocab, d_ff, kv heads) are computed in one place: `Derived`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from megatronish.errors import UserError

VOCAB_PAD_MULTIPLE = 128


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
    router: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    """softmax_topk: softmax over all experts, the top_k kept and renormalized to sum 1
    (Mixtral); topk_softmax: the top_k logits, then a softmax over them."""
    shared_expert: bool = False
    """Also run one dense SwiGLU expert of size d_ff on every token, added to the routed output."""


@dataclass
class ModelConfig:
    arch: Literal["gpt2", "llama"] = "gpt2"
    """gpt2: learned positions, LayerNorm, GELU, biases, tied embeddings. llama: RoPE, RMSNorm,
    SwiGLU, grouped-query attention, no biases, untied output layer."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention (query) heads; divisible by parallel.tp."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); divides n_head and is divisible by parallel.tp.
    Default: n_head (gpt2 always uses n_head)."""
    d_model: int = 128
    """Hidden size; divisible by n_head."""
    d_ff: int | None = None
    """MLP inner size, divisible by parallel.tp. Default: 4 * d_model for gpt2, and for llama
    8/3 * d_model rounded up to a multiple of 256 (the same at every tp)."""
    vocab_size: int | None = None
    """Tokens in the vocabulary. Default: the dataset's vocabulary (from its metadata)."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (size of gpt2's position table)."""
    dropout: float = 0.0
    """Dropout probability on attention probabilities and residual branches."""
    tie_embeddings: bool | None = None
    """Share the token embedding with the output layer. Default: true for gpt2, false for llama."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base (llama)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts MLPs (off by default); see model.moe.*."""


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
    timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the run fails instead of hanging."""


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
    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 autocast with fp32 weights, gradients and optimizer state."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """none; selective: recompute the attention core in backward; full: recompute each block."""
    log_every: int = 1
    """Write a metrics line (and update the progress bar) every this many steps."""
    eval_every: int = 50
    """Compute the validation loss every this many steps (and at the last step); 0: never."""
    eval_steps: int = 4
    """Global batches of the validation split per evaluation."""


@dataclass
class OptimConfig:
    zero: Literal[0, 1] = 0
    """0: every data-parallel rank holds the whole optimizer state; 1: the state is sharded
    across data-parallel ranks (ZeRO stage 1: gradients reduce-scattered, each rank updates
    its block, parameters all-gathered)."""
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
    backward and after the step)."""


@dataclass
class DataConfig:
    path: str | None = None
    """A directory written by `megatronish prepare`. Default: the built-in corpus (the Python
    standard library's source), prepared on first use into a cache directory."""


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
    init_from_hf: str | None = None
    """A Hugging Face model directory (config.json + model.safetensors) to start from."""


@dataclass
class KernelsConfig:
    backend: Literal["auto", "triton", "torch"] = "auto"
    """auto: Triton kernels on CUDA, torch ops elsewhere; triton; torch."""


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Loading


def _nearest(name: str, options: list[str], prefix: str) -> str:
    full = [f"{prefix}.{o}" if prefix else o for o in options]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{full[options.index(close[0])]}'?"
    return "valid keys: " + ", ".join(full)


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts) + " or null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, str(tp)
    )


def _coerce(key: str, value: Any, tp: Any, from_string: bool) -> Any:
    """value as type tp, or a UserError naming key and what is allowed."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (from_string and str(value).lower() in ("null", "none", "~")):
            return None
        return _coerce(key, value, inner[0], from_string)
    if origin is Literal:
        allowed = get_args(tp)
        if from_string and all(isinstance(a, int) for a in allowed):
            try:
                value = int(value)
            except ValueError:
                pass
        if value not in allowed:
            raise UserError(f"{key}: {value!r} is not valid; valid: {_describe(tp)}")
        return value
    bad = UserError(f"{key}: {value!r} is not {_describe(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_string and str(value).lower() in ("true", "false", "yes", "no", "1", "0"):
            return str(value).lower() in ("true", "yes", "1")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                try:
                    as_float = float(value)
                except ValueError:
                    raise bad from None
                if as_float.is_integer():
                    return int(as_float)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                result = float(value)
            except ValueError:
                raise bad from None
            if math.isfinite(result):
                return result
        raise bad
    if tp is str:
        if value is None:
            raise UserError(f"{key}: null is not valid; expected a string")
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    raise bad


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise UserError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in types_:
            raise UserError(f"unknown key '{dotted}'; {_nearest(str(key), sorted(types_), prefix)}")
        tp = types_[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, dotted)
        else:
            kwargs[key] = _coerce(dotted, value, tp, from_string=False)
    return cls(**kwargs)


def _apply_override(cfg: Config, assignment: str) -> None:
    if "=" not in assignment:
        raise UserError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.steps=20")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    target: Any = cfg
    for depth, part in enumerate(parts):
        types_ = _field_types(type(target))
        seen = ".".join(parts[:depth])
        if part not in types_:
            where = f"'{seen}.{part}'" if seen else f"'{part}'"
            raise UserError(f"--set: unknown key {where}; {_nearest(part, sorted(types_), seen)}")
        tp = types_[part]
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise UserError(f"--set {key}: is a section; set one of its keys, e.g. {key}.x=...")
            setattr(target, part, _coerce(key, raw, tp, from_string=True))
        else:
            if not dataclasses.is_dataclass(tp):
                raise UserError(f"--set {key}: '{'.'.join(parts[: depth + 1])}' has no sub-keys")
            target = getattr(target, part)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of YAML file `path` (None: defaults) with `--set` overrides applied, checked."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise UserError(f"config file {path}: not valid YAML{where}") from None
        except UnicodeDecodeError:
            raise UserError(f"config file {path}: not a text file") from None
    cfg = _build(Config, data, "")
    for assignment in overrides:
        _apply_override(cfg, assignment)
    check_values(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """A Config from a dict such as Config.to_dict() wrote (a checkpoint's resolved config)."""
    cfg = _build(Config, data, "")
    check_values(cfg)
    return cfg


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def check_values(cfg: Config) -> None:
    """Ranges of single values; checks between values and the world size are in `derive`."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for key, value in [
        ("model.n_layer", m.n_layer),
        ("model.n_head", m.n_head),
        ("model.d_model", m.d_model),
        ("model.max_seq_len", m.max_seq_len),
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("parallel.pp_virtual", p.pp_virtual),
        ("parallel.cp", p.cp),
        ("parallel.ep", p.ep),
        ("model.moe.top_k", m.moe.top_k),
        ("model.moe.every", m.moe.every),
        ("train.steps", t.steps),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size),
        ("train.seq_len", t.seq_len),
        ("train.log_every", t.log_every),
        ("train.max_skipped_steps", t.max_skipped_steps),
    ]:
        _require(value >= 1, f"{key}: {value} is not valid; must be a positive integer")
    for key, value in [
        ("model.n_kv_head", m.n_kv_head),
        ("model.d_ff", m.d_ff),
        ("model.vocab_size", m.vocab_size),
        ("model.moe.d_ff", m.moe.d_ff),
        ("parallel.dp", p.dp),
    ]:
        _require(value is None or value >= 1, f"{key}: {value} is not valid; must be >= 1 or null")
    _require(0.0 <= m.dropout < 1.0, f"model.dropout: {m.dropout} is not valid; must be in [0, 1)")
    _require(m.norm_eps > 0, f"model.norm_eps: {m.norm_eps} must be > 0")
    _require(t.lr > 0, f"train.lr: {t.lr} must be > 0")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr: {t.min_lr} must be in [0, train.lr={t.lr}]")
    _require(t.warmup_steps >= 0, f"train.warmup_steps: {t.warmup_steps} must be >= 0")
    _require(t.weight_decay >= 0, f"train.weight_decay: {t.weight_decay} must be >= 0")
    _require(t.grad_clip >= 0, f"train.grad_clip: {t.grad_clip} must be >= 0 (0 disables)")
    _require(t.eval_every >= 0, f"train.eval_every: {t.eval_every} must be >= 0 (0: never)")
    _require(t.eval_steps >= 1, f"train.eval_steps: {t.eval_steps} must be >= 1")
    _require(cfg.checkpoint.every >= 0, f"checkpoint.every: {cfg.checkpoint.every} must be >= 0")
    _require(cfg.checkpoint.keep >= 0, f"checkpoint.keep: {cfg.checkpoint.keep} must be >= 0")
    _require(p.timeout_s > 0, f"parallel.timeout_s: {p.timeout_s} must be > 0")
    _require(cfg.optim.bucket_mb > 0, f"optim.bucket_mb: {cfg.optim.bucket_mb} must be > 0")
    _require(
        0 < cfg.optim.beta1 < 1 and 0 < cfg.optim.beta2 < 1,
        "optim.beta1 and optim.beta2 must be in (0, 1)",
    )
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len: {t.seq_len} is longer than model.max_seq_len={m.max_seq_len}",
    )
    _require(
        m.arch != "gpt2" or m.n_kv_head in (None, m.n_head),
        f"model.n_kv_head: gpt2 uses n_kv_head = n_head = {m.n_head}; got {m.n_kv_head}",
    )
    check_moe_values(cfg)
    o = cfg.observe
    _require(o.straggler_ratio > 1, f"observe.straggler_ratio: {o.straggler_ratio} must be > 1")
    _require(o.flight_recorder >= 0, f"observe.flight_recorder: {o.flight_recorder} must be >= 0")
    profile_steps(cfg)
    profile_ranks(cfg)


def check_moe_values(cfg: Config) -> None:
    """The model.moe values on their own, and parallel.ep against them."""
    moe, ep = cfg.model.moe, cfg.parallel.ep
    _require(
        moe.num_experts >= 0,
        f"model.moe.num_experts: {moe.num_experts} is not valid; 0 (dense) or a positive integer",
    )
    _require(
        ep == 1 or moe.num_experts > 0,
        f"parallel.ep: {ep} needs experts to split; set model.moe.num_experts (a multiple of "
        f"{ep}) or parallel.ep=1",
    )
    if moe.num_experts == 0:
        return
    _require(
        cfg.model.arch == "llama",
        f"model.moe: experts are SwiGLU (llama); model.arch {cfg.model.arch!r} is not supported "
        "with model.moe.num_experts > 0; set model.arch=llama",
    )
    _require(
        moe.top_k <= moe.num_experts,
        f"model.moe.top_k: {moe.top_k} is more than model.moe.num_experts={moe.num_experts}; "
        f"valid: 1 to {moe.num_experts}",
    )
    _require(
        moe.num_experts % ep == 0,
        f"model.moe.num_experts: {moe.num_experts} is not divisible by parallel.ep={ep}; "
        f"valid ep: {', '.join(str(d) for d in _divisors(moe.num_experts))}",
    )
    for key, value in (("aux_loss_coef", moe.aux_loss_coef), ("z_loss_coef", moe.z_loss_coef)):
        _require(value >= 0, f"model.moe.{key}: {value} must be >= 0 (0 turns it off)")
    _require(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor: {moe.capacity_factor} must be > 0, or null (dropless)",
    )


def moe_layers(cfg: Config) -> tuple[int, ...]:
    """The indices of the blocks whose MLP is a mixture of experts (none when moe is off)."""
    moe = cfg.model.moe
    if moe.num_experts == 0:
        return ()
    return tuple(range(0, cfg.model.n_layer, moe.every))


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
    _require(
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
    _require(
        all(r >= 0 for r in ranks),
        f"observe.profile_ranks: {spec!r} is not valid; expected all, or comma-separated "
        'global ranks such as "0,3"',
    )
    return ranks


# --------------------------------------------------------------------------------------------
# Derived sizes


@dataclass(frozen=True)
class Derived:
    """Sizes that follow from the config and the world size, computed only here."""

    world_size: int
    tp: int
    dp: int
    pp: int
    grad_accum_steps: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    vocab_size: int
    padded_vocab_size: int
    tie_embeddings: bool
    tokens_per_step: int
    stage_layers: tuple[int, ...] = (1,)
    """Transformer layers on each pipeline rank (all its model chunks), in rank order."""
    cp: int = 1
    """Context-parallel degree; each rank holds seq_len / cp tokens of every sequence."""
    pp_virtual: int = 1
    """Model chunks per pipeline rank: parallel.pp_virtual at pp > 1, else 1."""
    chunk_layers: tuple[int, ...] = (1,)
    """Transformer layers of each of the pp x pp_virtual model chunks, in model order; rank r
    holds chunks r, r + pp, r + 2 pp, ..."""
    ep: int = 1
    """Expert-parallel degree (inside dp); each ep rank holds num_experts / ep experts."""
    moe_layers: tuple[int, ...] = ()
    """The blocks with a mixture-of-experts MLP."""
    moe_d_ff: int = 0
    """Inner size of one expert (0 without experts)."""

    def chunk_range(self, chunk: int) -> range:
        """The global indices of the transformer layers of model chunk `chunk`."""
        start = sum(self.chunk_layers[:chunk])
        return range(start, start + self.chunk_layers[chunk])

    def stage_chunks(self, pp_rank: int) -> list[range]:
        """The layer ranges of pipeline rank pp_rank's model chunks, in model order (one range
        at pp_virtual 1: the stage)."""
        return [self.chunk_range(pp_rank + j * self.pp) for j in range(self.pp_virtual)]


def padded_vocab(vocab_size: int, tp: int) -> int:
    """vocab_size rounded up to a multiple of 128 * tp (Megatron's padding)."""
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


def virtual_stages(cfg: Config) -> int:
    """Model chunks per pipeline rank: parallel.pp_virtual, or 1 at pp = 1."""
    return cfg.parallel.pp_virtual if cfg.parallel.pp > 1 else 1


def chunk_layers(cfg: Config) -> tuple[int, ...]:
    """Transformer layers per model chunk (pp x pp_virtual chunks; per stage at pp_virtual 1):
    parallel.pp_layers, or an even split, earlier chunks taking the remainder."""
    n, pp, spec = cfg.model.n_layer, cfg.parallel.pp, cfg.parallel.pp_layers
    virtual = virtual_stages(cfg)
    chunks = pp * virtual
    if virtual == 1:
        _require(
            n >= pp,
            f"parallel.pp: {pp} stages need at least {pp} layers; model.n_layer is {n}",
        )
    else:
        _require(
            n >= chunks,
            f"parallel.pp_virtual: {pp} stages x {virtual} chunks need at least {chunks} layers; "
            f"model.n_layer is {n}",
        )
    base, extra = divmod(n, chunks)
    even = tuple(base + (1 if chunk < extra else 0) for chunk in range(chunks))
    if spec is None:
        return even
    try:
        layers = tuple(int(part) for part in spec.split(","))
    except ValueError:
        layers = ()
    what = f"{pp}" if virtual == 1 else f"{chunks} (parallel.pp x parallel.pp_virtual)"
    _require(
        len(layers) == chunks and all(x >= 1 for x in layers) and sum(layers) == n,
        f"parallel.pp_layers: {spec!r} is not valid; expected {what} positive integers, "
        f'comma-separated, that sum to model.n_layer={n} (e.g. "{",".join(map(str, even))}")',
    )
    return layers


def world_size_of(cfg: Config) -> int:
    """The processes a config asks for: tp * cp * pp * (parallel.dp, or 1 when unset)."""
    p = cfg.parallel
    return p.tp * p.cp * p.pp * (p.dp or 1)


def derive(cfg: Config, world_size: int, vocab_size: int | None = None) -> Derived:
    """Every derived size, after the checks between values; vocab_size is the dataset's when the
    config leaves model.vocab_size unset."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp, cp = p.tp, p.pp, p.cp
    _require(world_size >= 1, f"world size {world_size} is not valid; must be >= 1")
    _require(
        world_size % (tp * cp * pp) == 0,
        f"world size {world_size} is not divisible by parallel.tp * parallel.cp * parallel.pp = "
        f"{tp} * {cp} * {pp} = {tp * cp * pp}",
    )
    dp = p.dp if p.dp is not None else world_size // (tp * cp * pp)
    _require(
        tp * cp * dp * pp == world_size,
        f"world size {world_size} != parallel.tp * parallel.cp * parallel.dp * parallel.pp = "
        f"{tp} * {cp} * {dp} * {pp}; launch {tp * cp * dp * pp} processes or change parallel.dp",
    )
    if cp > 1:
        _require(
            t.seq_len % (2 * cp) == 0,
            f"train.seq_len: {t.seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each cp "
            f"rank holds two chunks of every sequence); valid: a multiple of {2 * cp}",
        )
        _require(
            m.dropout == 0,
            f"model.dropout: {m.dropout} is not supported with parallel.cp={cp} (ring attention "
            "has no attention dropout); set model.dropout=0 or parallel.cp=1",
        )
    n_kv = m.n_kv_head if m.n_kv_head is not None else m.n_head
    _require(
        m.n_head % tp == 0,
        f"model.n_head: {m.n_head} is not divisible by parallel.tp={tp}; "
        f"valid tp: {', '.join(str(d) for d in _divisors(m.n_head))}",
    )
    _require(
        m.n_head % n_kv == 0, f"model.n_kv_head: {n_kv} does not divide model.n_head={m.n_head}"
    )
    _require(
        n_kv % tp == 0,
        f"model.n_kv_head: {n_kv} is not divisible by parallel.tp={tp}; "
        f"valid tp: {', '.join(str(d) for d in _divisors(n_kv))}",
    )
    _require(
        m.d_model % m.n_head == 0,
        f"model.d_model: {m.d_model} is not divisible by model.n_head={m.n_head}",
    )
    head_dim = m.d_model // m.n_head
    if m.arch == "llama":
        _require(
            head_dim % 2 == 0, f"model.d_model / model.n_head = {head_dim} must be even (RoPE)"
        )
    if m.d_ff is not None:
        d_ff = m.d_ff
    elif m.arch == "gpt2":
        d_ff = 4 * m.d_model
    else:
        d_ff = -(-(8 * m.d_model // 3) // 256) * 256
    _require(d_ff % tp == 0, f"model.d_ff: {d_ff} is not divisible by parallel.tp={tp}")
    micro_total = t.micro_batch_size * dp
    _require(
        t.global_batch_size % micro_total == 0,
        f"train.global_batch_size: {t.global_batch_size} is not divisible by "
        f"train.micro_batch_size * dp = {t.micro_batch_size} * {dp} = {micro_total}",
    )
    vocab = m.vocab_size if m.vocab_size is not None else vocab_size
    _require(vocab is not None, "model.vocab_size: not set and no dataset to take it from")
    tie = m.tie_embeddings if m.tie_embeddings is not None else m.arch == "gpt2"
    _require(
        not (p.sequence_parallel and tp > 1 and (t.seq_len // cp) % tp != 0),
        f"train.seq_len: {t.seq_len} / parallel.cp={cp} must be divisible by parallel.tp={tp} "
        "with sequence_parallel",
    )
    accum = t.global_batch_size // micro_total
    virtual = virtual_stages(cfg)
    if virtual > 1:
        valid = micro_total * pp * max(1, -(-accum // pp))
        _require(
            accum % pp == 0,
            f"parallel.pp_virtual: {virtual} (interleaved) needs the micro-batches per step, "
            f"train.global_batch_size / (train.micro_batch_size * dp) = {accum}, to be a multiple "
            f"of parallel.pp={pp}; e.g. train.global_batch_size={valid}",
        )
    moe_d_ff = 0
    if m.moe.num_experts > 0:
        ep = p.ep
        _require(
            dp % ep == 0,
            f"parallel.ep: {ep} does not divide the data-parallel degree {dp} (experts are split "
            f"over ep of the dp ranks); valid ep: {', '.join(str(d) for d in _divisors(dp))}",
        )
        moe_d_ff = m.moe.d_ff if m.moe.d_ff is not None else d_ff
        _require(
            moe_d_ff % tp == 0, f"model.moe.d_ff: {moe_d_ff} is not divisible by parallel.tp={tp}"
        )
    chunks = chunk_layers(cfg)
    return Derived(
        world_size=world_size,
        tp=tp,
        dp=dp,
        pp=pp,
        grad_accum_steps=accum,
        n_kv_head=n_kv,
        head_dim=head_dim,
        d_ff=d_ff,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab(vocab, tp),
        tie_embeddings=tie,
        tokens_per_step=t.global_batch_size * t.seq_len,
        stage_layers=tuple(sum(chunks[r::pp]) for r in range(pp)),
        cp=cp,
        pp_virtual=virtual,
        chunk_layers=chunks,
        ep=p.ep if m.moe.num_experts > 0 else 1,
        moe_layers=moe_layers(cfg),
        moe_d_ff=moe_d_ff,
    )


def check_dataset_vocab(cfg: Config, data_vocab: int, dataset: str | Path) -> None:
    """model.vocab_size, when set, must hold every token id of the dataset."""
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < data_vocab:
        raise UserError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the vocabulary of the "
            f"dataset {dataset} ({data_vocab}); set at least {data_vocab}, or leave it unset"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
