"""Remembered accounting (megatronish.accounting.memo): inside ``remembering`` a count is
computed once for the same config object and arguments, outside it every call computes (a
config changed later is never answered from an old result), and a remembered per-layer count
is the count itself, block by block, whatever each block's attention kind."""

from __future__ import annotations

from megatronish.accounting.memo import per_config, remembering
from megatronish.accounting.memory import activation_bytes_per_layer
from megatronish.accounting.parameters import layer_params, local_parameter_count
from megatronish.config import Config, derive, load_config
from tests.conftest import CONFIGS


def test_a_count_is_computed_once_inside_remembering_and_every_call_outside():
    calls = []

    @per_config
    def heads(cfg: Config, derived: None, tp: int) -> int:
        calls.append(tp)
        return cfg.model.n_head // tp

    cfg = Config()
    with remembering():
        assert [heads(cfg, None, 2) for _ in range(3)] == [cfg.model.n_head // 2] * 3
        assert heads(cfg, None, 1) == cfg.model.n_head
    assert calls == [2, 1]
    cfg.model.n_head *= 2  # changed after leaving: computed again, not remembered
    assert heads(cfg, None, 2) == cfg.model.n_head // 2
    assert calls == [2, 1, 2]


def test_remembered_layer_counts_equal_the_counts_block_by_block_across_attention_kinds():
    cfg = load_config(CONFIGS / "tiny-qwen3_5.yaml", [])  # linear and full attention blocks
    derived = derive(cfg, 1, vocab_size=257)
    blocks = range(cfg.model.n_layer)

    def counts() -> list:
        params = [layer_params(cfg, derived, 1, moe, i) for moe in (False, True) for i in blocks]
        kept = [
            activation_bytes_per_layer(cfg, 1, False, recompute, i)
            for recompute in ("none", "selective", "full")
            for i in blocks
        ]
        return [*params, *kept, local_parameter_count(cfg, derived, 0)]

    plain = counts()
    assert len(set(plain[: len(blocks)])) == 2  # the two kinds differ
    with remembering():
        assert counts() == plain
        assert counts() == plain
