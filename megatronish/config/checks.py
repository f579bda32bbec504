"""Range checks of single config values, each failing with a UserError that names the key and
what is valid. Checks between values and the world size are in config.derive."""

from __future__ import annotations

from pathlib import Path

from megatronish.config.schema import Config
from megatronish.errors import UserError
from megatronish.paths import require_output_dir


def require(cond: bool, message: str) -> None:
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
        require(value >= 1, f"{key}: {value} is not valid; must be a positive integer")
    for key, value in [
        ("model.n_kv_head", m.n_kv_head),
        ("model.d_ff", m.d_ff),
        ("model.vocab_size", m.vocab_size),
        ("model.moe.d_ff", m.moe.d_ff),
        ("parallel.dp", p.dp),
    ]:
        require(value is None or value >= 1, f"{key}: {value} is not valid; must be >= 1 or null")
    require(0.0 <= m.dropout < 1.0, f"model.dropout: {m.dropout} is not valid; must be in [0, 1)")
    require(m.norm_eps > 0, f"model.norm_eps: {m.norm_eps} must be > 0")
    require(t.lr > 0, f"train.lr: {t.lr} must be > 0")
    require(0 <= t.min_lr <= t.lr, f"train.min_lr: {t.min_lr} must be in [0, train.lr={t.lr}]")
    require(t.warmup_steps >= 0, f"train.warmup_steps: {t.warmup_steps} must be >= 0")
    require(t.weight_decay >= 0, f"train.weight_decay: {t.weight_decay} must be >= 0")
    require(t.grad_clip >= 0, f"train.grad_clip: {t.grad_clip} must be >= 0 (0 disables)")
    require(t.eval_every >= 0, f"train.eval_every: {t.eval_every} must be >= 0 (0: never)")
    require(t.eval_steps >= 1, f"train.eval_steps: {t.eval_steps} must be >= 1")
    require(cfg.checkpoint.every >= 0, f"checkpoint.every: {cfg.checkpoint.every} must be >= 0")
    require(cfg.checkpoint.keep >= 0, f"checkpoint.keep: {cfg.checkpoint.keep} must be >= 0")
    require(p.timeout_s > 0, f"parallel.timeout_s: {p.timeout_s} must be > 0")
    require(cfg.optim.bucket_mb > 0, f"optim.bucket_mb: {cfg.optim.bucket_mb} must be > 0")
    require(
        0 < cfg.optim.beta1 < 1 and 0 < cfg.optim.beta2 < 1,
        "optim.beta1 and optim.beta2 must be in (0, 1)",
    )
    require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len: {t.seq_len} is longer than model.max_seq_len={m.max_seq_len}",
    )
    require(
        m.arch != "gpt2" or m.n_kv_head in (None, m.n_head),
        f"model.n_kv_head: gpt2 uses n_kv_head = n_head = {m.n_head}; got {m.n_kv_head}",
    )
    check_moe_values(cfg)
    o = cfg.observe
    require(o.straggler_ratio > 1, f"observe.straggler_ratio: {o.straggler_ratio} must be > 1")
    require(o.flight_recorder >= 0, f"observe.flight_recorder: {o.flight_recorder} must be >= 0")
    profile_steps(cfg)
    profile_ranks(cfg)


def check_moe_values(cfg: Config) -> None:
    """The model.moe values on their own, and parallel.ep against them."""
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
        cfg.model.arch == "llama",
        f"model.moe: experts are SwiGLU (llama); model.arch {cfg.model.arch!r} is not supported "
        "with model.moe.num_experts > 0; set model.arch=llama",
    )
    require(
        moe.top_k <= moe.num_experts,
        f"model.moe.top_k: {moe.top_k} is more than model.moe.num_experts={moe.num_experts}; "
        f"valid: 1 to {moe.num_experts}",
    )
    require(
        moe.num_experts % ep == 0,
        f"model.moe.num_experts: {moe.num_experts} is not divisible by parallel.ep={ep}; "
        f"valid ep: {', '.join(str(d) for d in divisors(moe.num_experts))}",
    )
    for key, value in (("aux_loss_coef", moe.aux_loss_coef), ("z_loss_coef", moe.z_loss_coef)):
        require(value >= 0, f"model.moe.{key}: {value} must be >= 0 (0 turns it off)")
    require(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor: {moe.capacity_factor} must be > 0, or null (dropless)",
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


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (the valid degrees a message lists)."""
    return [d for d in range(1, n + 1) if n % d == 0]
