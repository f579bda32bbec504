"""Sizes that follow from the config and the world size (data-parallel degree, gradient
accumulation, padded vocab, d_ff, kv heads, pipeline chunks, MoE layers), computed only here:
`derive` returns them as one frozen `Derived`, or a UserError naming the key that does not fit."""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.config.checks import value_checks
from megatronish.config.degrees import with_valid_values
from megatronish.config.kernel_dims import check_triton_head_dims
from megatronish.config.layout_checks import check_context_parallel, check_fp8_blocks, moe_layers
from megatronish.config.model_checks import check_linear_heads_split
from megatronish.config.rules import VALID, DegreeError, divisors, require, require_degree
from megatronish.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig

VOCAB_PAD_MULTIPLE = 128


def attention_window(model: ModelConfig, layer: int) -> int | None:
    """The sliding window of block `layer` (its global index), None for every earlier
    position: with model.layer_types, model.sliding_window where it says sliding_attention;
    without, model.sliding_window for the blocks after the first model.full_attention_layers."""
    types = model.layer_types
    if types is not None and layer < len(types):
        return model.sliding_window if types[layer] == "sliding_attention" else None
    if model.sliding_window is None or layer < model.full_attention_layers:
        return None
    return model.sliding_window


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
    """The query-key head dim (under mla qk_nope_head_dim + qk_rope_head_dim)."""
    v_head_dim: int
    """The value head dim: head_dim, or under mla model.mla.v_head_dim."""
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
    """The blocks with a mixture-of-experts MLP, multi-token prediction's too (moe_layers)."""
    moe_d_ff: int = 0
    """Inner size of one expert (0 without experts)."""
    shared_d_ff: int = 0
    """Inner size of the shared experts' MLP of each MoE block: n_shared_experts (or one for
    shared_expert) x moe_d_ff; 0 without shared experts."""
    last_stage_embedding: bool = False
    """The last stage looks tokens up in the token embedding too (a tied output layer, or the
    multi-token prediction modules): at pp > 1 it holds a copy kept equal to the first stage's."""

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
    n_layer, pp, spec = cfg.model.n_layer, cfg.parallel.pp, cfg.parallel.pp_layers
    virtual = virtual_stages(cfg)
    chunks = pp * virtual
    if virtual == 1:
        require(
            n_layer >= pp,
            f"parallel.pp: {pp} stages need at least {pp} layers; model.n_layer is {n_layer}",
        )
    else:
        require(
            n_layer >= chunks,
            f"parallel.pp_virtual: {pp} stages x {virtual} chunks need at least {chunks} layers; "
            f"model.n_layer is {n_layer}",
        )
    base, extra = divmod(n_layer, chunks)
    even = tuple(base + (1 if chunk < extra else 0) for chunk in range(chunks))
    if spec is None:
        return even
    try:
        layers = tuple(int(part) for part in spec.split(","))
    except ValueError:
        layers = ()
    what = f"{pp}" if virtual == 1 else f"{chunks} (parallel.pp x parallel.pp_virtual)"
    require(
        len(layers) == chunks and all(x >= 1 for x in layers) and sum(layers) == n_layer,
        f"parallel.pp_layers: {spec!r} is not valid; expected {what} positive integers, "
        f'comma-separated, that sum to model.n_layer={n_layer} (e.g. "{",".join(map(str, even))}")',
    )
    return layers


def world_size_of(cfg: Config, dp: int = 1) -> int:
    """The processes a config asks for: tp * cp * pp * (parallel.dp, or dp when unset)."""
    parallel = cfg.parallel
    return parallel.tp * parallel.cp * parallel.pp * (parallel.dp or dp)


def derive(cfg: Config, world_size: int, vocab_size: int | None = None) -> Derived:
    """Every derived size, after the checks between values; vocab_size is the dataset's when the
    config leaves model.vocab_size unset. A message that suggests degrees lists those that pass
    every check, each at the same data-parallel degree (the world it then asks for)."""
    try:
        return _derive(cfg, world_size, vocab_size)
    except DegreeError as exc:
        dp = world_size // (cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp)

        def checks(candidate: Config) -> None:
            value_checks(candidate)
            _derive(candidate, world_size_of(candidate, dp), vocab_size)

        raise with_valid_values(exc, cfg, checks) from None


def _derive(cfg: Config, world_size: int, vocab_size: int | None) -> Derived:
    """derive without the suggested degrees filled in."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    dp = _data_parallel_degree(parallel, world_size)
    if cp > 1:
        check_context_parallel(cfg)
    n_kv, head_dim = _head_sizes(model, tp)
    check_linear_heads_split(cfg)
    check_triton_head_dims(cfg, head_dim)
    d_ff = _ffn_size(model, tp)
    accum = _grad_accum_steps(train, dp)
    vocab = model.vocab_size if model.vocab_size is not None else vocab_size
    require(vocab is not None, "model.vocab_size: not set and no dataset to take it from")
    tie = model.tie_embeddings
    tie = model.components.tied_output if tie is None else tie
    require(
        not (parallel.sequence_parallel and tp > 1 and (train.seq_len // cp) % tp != 0),
        f"train.seq_len: {train.seq_len} / parallel.cp={cp} must be divisible by "
        f"parallel.tp={tp} with sequence_parallel",
    )
    require(
        not (parallel.tp_comm_overlap and tp > 1 and (train.seq_len // cp) % tp != 0),
        f"train.seq_len: {train.seq_len} / parallel.cp={cp} must be divisible by "
        f"parallel.tp={tp} with parallel.tp_comm_overlap (the sequence is cut into tp chunks)",
    )
    virtual = virtual_stages(cfg)
    if virtual > 1:
        _check_interleaving(train, dp, pp, virtual, accum)
    moe_d_ff = _expert_ffn_size(model, parallel, dp, d_ff) if model.moe.num_experts > 0 else 0
    if train.precision == "fp8" and train.fp8_recipe == "blockwise" and tp > 1:
        check_fp8_blocks(cfg, n_kv, head_dim, d_ff, moe_d_ff)
    chunks = chunk_layers(cfg)
    return Derived(
        world_size=world_size,
        tp=tp,
        dp=dp,
        pp=pp,
        grad_accum_steps=accum,
        n_kv_head=n_kv,
        head_dim=head_dim,
        v_head_dim=model.mla.v_head_dim if model.attention == "mla" else head_dim,
        d_ff=d_ff,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab(vocab, tp),
        tie_embeddings=tie,
        tokens_per_step=train.global_batch_size * train.seq_len,
        stage_layers=tuple(sum(chunks[r::pp]) for r in range(pp)),
        cp=cp,
        pp_virtual=virtual,
        chunk_layers=chunks,
        ep=parallel.ep if model.moe.num_experts > 0 else 1,
        moe_layers=moe_layers(cfg),
        moe_d_ff=moe_d_ff,
        shared_d_ff=moe_d_ff * (model.moe.n_shared_experts or int(model.moe.shared_expert)),
        last_stage_embedding=tie or model.mtp_depth > 0,
    )


def layout_notes(cfg: Config, derived: Derived) -> list[str]:
    """Settings that have no effect at this layout, one line each (train says them once, check
    prints them)."""
    notes = []
    if cfg.parallel.tp_comm_overlap and derived.tp == 1:
        notes.append("parallel.tp_comm_overlap: no effect at parallel.tp=1 (no tp communication)")
    return notes


def _data_parallel_degree(parallel: ParallelConfig, world_size: int) -> int:
    """parallel.dp, or the world size's share left by tp x cp x pp, once the world fits."""
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    require(world_size >= 1, f"world size {world_size} is not valid; must be >= 1")
    require(
        world_size % (tp * cp * pp) == 0,
        f"world size {world_size} is not divisible by parallel.tp * parallel.cp * parallel.pp = "
        f"{tp} * {cp} * {pp} = {tp * cp * pp}",
    )
    dp = parallel.dp if parallel.dp is not None else world_size // (tp * cp * pp)
    require(
        tp * cp * dp * pp == world_size,
        f"world size {world_size} != parallel.tp * parallel.cp * parallel.dp * parallel.pp = "
        f"{tp} * {cp} * {dp} * {pp}; launch {tp * cp * dp * pp} processes or change parallel.dp",
    )
    return dp


def _head_sizes(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(kv heads, head dim: model.head_dim or d_model / n_head; under mla n_head and the
    query-key head dim qk_nope_head_dim + qk_rope_head_dim), once the heads split over tp and
    into the kv groups."""
    n_kv = model.n_kv_head if model.n_kv_head is not None else model.n_head
    require_degree(
        model.n_head % tp == 0,
        f"model.n_head: {model.n_head} is not divisible by parallel.tp={tp}; valid tp: {VALID}",
        "parallel.tp",
        divisors(model.n_head),
    )
    require(
        model.n_head % n_kv == 0,
        f"model.n_kv_head: {n_kv} does not divide model.n_head={model.n_head}",
    )
    require_degree(
        n_kv % tp == 0,
        f"model.n_kv_head: {n_kv} is not divisible by parallel.tp={tp}; valid tp: {VALID}",
        "parallel.tp",
        divisors(n_kv),
    )
    if model.attention == "mla":  # every head its own keys; the query-key head dim
        return n_kv, model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim
    if model.head_dim is not None:
        require(
            model.head_dim % 2 == 0,
            f"model.head_dim: {model.head_dim} is not valid; must be a positive even integer "
            "(RoPE)",
        )
        return n_kv, head_dim_of(model)
    require(
        model.d_model % model.n_head == 0,
        f"model.d_model: {model.d_model} is not divisible by model.n_head={model.n_head}",
    )
    head_dim = head_dim_of(model)
    if model.components.rope:
        require(head_dim % 2 == 0, f"model.d_model / model.n_head = {head_dim} must be even (RoPE)")
    return n_kv, head_dim


def head_dim_of(model: ModelConfig) -> int:
    """The size of one attention head: model.head_dim, or d_model / n_head when it is unset."""
    return model.head_dim if model.head_dim is not None else model.d_model // model.n_head


def _ffn_size(model: ModelConfig, tp: int) -> int:
    """model.d_ff, or the architecture's default (4 d_model; Llama's 8/3 d_model rounded up to
    a multiple of 256), once it splits over tp."""
    if model.d_ff is not None:
        d_ff = model.d_ff
    elif not model.components.gated_mlp:
        d_ff = 4 * model.d_model
    else:
        d_ff = -(-(8 * model.d_model // 3) // 256) * 256
    require(d_ff % tp == 0, f"model.d_ff: {d_ff} is not divisible by parallel.tp={tp}")
    return d_ff


def _grad_accum_steps(train: TrainConfig, dp: int) -> int:
    """Micro-batches per step on each dp rank, once the global batch splits into them."""
    micro_total = train.micro_batch_size * dp
    require(
        train.global_batch_size % micro_total == 0,
        f"train.global_batch_size: {train.global_batch_size} is not divisible by "
        f"train.micro_batch_size * dp = {train.micro_batch_size} * {dp} = {micro_total}",
    )
    return train.global_batch_size // micro_total


def _check_interleaving(train: TrainConfig, dp: int, pp: int, virtual: int, accum: int) -> None:
    """What the interleaved schedule (virtual > 1 chunks a stage) needs of the micro-batches."""
    micro_total = train.micro_batch_size * dp
    valid = micro_total * pp * max(1, -(-accum // pp))
    require(
        accum % pp == 0,
        f"parallel.pp_virtual: {virtual} (interleaved) needs the micro-batches per step, "
        f"train.global_batch_size / (train.micro_batch_size * dp) = {accum}, to be a multiple "
        f"of parallel.pp={pp}; e.g. train.global_batch_size={valid}",
    )


def _expert_ffn_size(model: ModelConfig, parallel: ParallelConfig, dp: int, d_ff: int) -> int:
    """model.moe.d_ff (default: the dense d_ff), once ep divides dp and it splits over tp."""
    ep = parallel.ep
    require_degree(
        dp % ep == 0 and model.moe.num_experts % ep == 0,
        f"parallel.ep: {ep} does not divide both the data-parallel degree {dp} and "
        f"model.moe.num_experts={model.moe.num_experts} (experts are split over ep of the dp "
        f"ranks); valid ep: {VALID}",
        "parallel.ep",
        divisors(dp),
    )
    moe_d_ff = model.moe.d_ff if model.moe.d_ff is not None else d_ff
    require(
        moe_d_ff % parallel.tp == 0,
        f"model.moe.d_ff: {moe_d_ff} is not divisible by parallel.tp={parallel.tp}",
    )
    return moe_d_ff
