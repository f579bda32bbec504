"""Checks of a layout that the whole config takes part in: what context parallelism needs of
the sequence, dropout and blockwise fp8, and what blockwise fp8 needs of each rank's share of a
split dimension at tp > 1; and which blocks are MoE blocks (``moe_layers``), which they read.
config.derive runs them."""

from __future__ import annotations

from megatronish.config.rules import VALID, divisors, require, require_degree
from megatronish.config.schema import Config

FP8_BLOCK = 128
"""The side of a blockwise fp8 scaling block (megatronish.fp8.granularity.BLOCK)."""


def moe_layers(cfg: Config) -> tuple[int, ...]:
    """The MoE blocks: i >= moe.first_k_dense, multiples of moe.every (none without experts),
    of the blocks and the multi-token prediction blocks n_layer .. n_layer + mtp_depth - 1."""
    moe, blocks = cfg.model.moe, cfg.model.n_layer + cfg.model.mtp_depth
    if moe.num_experts == 0:
        return ()
    return tuple(i for i in range(moe.first_k_dense, blocks) if i % moe.every == 0)


def check_context_parallel(cfg: Config) -> None:
    """What parallel.cp > 1 needs of the sequence length (chunks no shorter than the linear
    attention's convolution tail) and dropout, and of blockwise fp8: whole 128-token tiles in
    each zigzag chunk, and no experts."""
    cp, seq_len, dropout = cfg.parallel.cp, cfg.train.seq_len, cfg.model.dropout
    require(
        seq_len % (2 * cp) == 0,
        f"train.seq_len: {seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each cp "
        f"rank holds two chunks of every sequence); valid: a multiple of {2 * cp}",
    )
    chunk = seq_len // (2 * cp)
    tail = cfg.model.linear_conv_kernel_dim - 1
    require(
        "linear_attention" not in (cfg.model.layer_types or ()) or chunk >= tail,
        f"parallel.cp: {cp} cuts train.seq_len={seq_len} into chunks of {chunk} tokens, shorter "
        f"than the linear attention's convolution tail (model.linear_conv_kernel_dim - 1 = "
        f"{tail}), which a chunk takes from the chunk before it; valid: a train.seq_len of at "
        f"least {2 * cp * tail}, or a smaller parallel.cp",
    )
    require(
        not (cfg.train.precision == "fp8" and cfg.train.fp8_recipe == "blockwise")
        or chunk % FP8_BLOCK == 0,
        f"train.fp8_recipe: blockwise at parallel.cp={cp} cuts train.seq_len={seq_len} into "
        f"chunks of {chunk} tokens, not a multiple of {FP8_BLOCK} (a weight-gradient tile of "
        f"{FP8_BLOCK} tokens would straddle two cp ranks); valid: a seq_len that is a multiple "
        f"of {2 * cp * FP8_BLOCK}, or another fp8_recipe",
    )
    require(
        not (cfg.train.precision == "fp8" and cfg.train.fp8_recipe == "blockwise")
        or cfg.model.moe.num_experts == 0,
        f"train.fp8_recipe: blockwise with model.moe.num_experts={cfg.model.moe.num_experts} at "
        f"parallel.cp={cp}: an expert's weight-gradient tiles of {FP8_BLOCK} tokens would "
        "straddle the cp ranks' shares of a micro-batch (an expert's rows are not whole chunks); "
        "valid: parallel.cp=1, or fp8_recipe tensorwise or rowwise",
    )
    require(
        dropout == 0,
        f"model.dropout: {dropout} is not supported with parallel.cp={cp} (ring attention "
        "has no attention dropout); set model.dropout=0 or parallel.cp=1",
    )


def check_fp8_blocks(cfg: Config, n_kv: int, head_dim: int, d_ff: int, moe_d_ff: int) -> None:
    """Blockwise fp8 at tp > 1: each rank's share of a split dimension of an fp8 linear layer
    (the qkv outputs, the query heads and the key and value heads, a dense MLP's d_ff, an
    expert's and so the shared experts' d_ff) is whole 128-wide blocks, so no tile or block
    straddles two ranks and every tp scales the same groups."""
    model, tp = cfg.model, cfg.parallel.tp
    sizes = [
        (
            "the qkv outputs (model.n_head + 2 model.n_kv_head) x head dim",
            (model.n_head + 2 * n_kv) * head_dim,
        ),
        ("the attention heads model.n_head x head dim", model.n_head * head_dim),
        # q, k and v are tiled each from its own first row (megatronish.fp8.parts)
        ("the key and value heads model.n_kv_head x head dim", n_kv * head_dim),
    ]
    if model.attention == "mla":  # its up-projections and output projection split over tp
        mla = model.mla
        sizes = [
            ("the queries model.n_head x (qk_nope_head_dim + qk_rope_head_dim)", n_kv * head_dim),
            (
                "the keys and values model.n_head x (qk_nope_head_dim + v_head_dim)",
                model.n_head * (mla.qk_nope_head_dim + mla.v_head_dim),
            ),
            ("the attention heads model.n_head x v_head_dim", model.n_head * mla.v_head_dim),
        ]
    if len(moe_layers(cfg)) < model.n_layer + model.mtp_depth:  # dense MLPs
        sizes.append(("model.d_ff", d_ff))
    if moe_d_ff:  # the experts (the shared experts' d_ff is a multiple of theirs)
        sizes.append(("model.moe.d_ff", moe_d_ff))
    for what, size in sizes:
        require_degree(
            (size // tp) % FP8_BLOCK == 0,
            f"train.fp8_recipe: blockwise splits {what} = {size} over parallel.tp={tp} into "
            f"{size // tp} per rank, not a multiple of {FP8_BLOCK} (a block would straddle two "
            f"ranks); valid tp: {VALID}, or another fp8_recipe",
            "parallel.tp",
            divisors(model.n_head),
        )
