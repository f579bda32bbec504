"""A checkpoint saved at one layout loads at any other: the same logits at tp = 1, 2 and 4, and
the same AdamW state (multi-token prediction's too), re-sharded and with the vocab re-padded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatronish import load_model
from megatronish.checkpoint.convert import convert_checkpoint
from megatronish.checkpoint.load import restore_model, restore_optimizer
from megatronish.checkpoint.reader import Checkpoint
from megatronish.checkpoint.save import save_checkpoint
from megatronish.config import derive
from megatronish.data_parallel import data_parallel_for
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.hf.exporter import export_hf
from megatronish.layers import mappings
from megatronish.layers.roles import role
from megatronish.model import GPT
from tests.checkpoints import BYTES, VOCAB, tiny_cfg, tokens, trained
from tests.ranks import run_on_ranks
from tests.tolerances import EXACT, FP32_REORDER

# both vocab-sized tensors, embedding and output layer; and a multi-token prediction module,
# whose replicated eh_proj and split block are re-sharded with the rest
UNTIED = ("model.tie_embeddings=false", "model.mtp_depth=1")


def _local_optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s["exp_avg"].clone() for p, s in optimizer.update.state.items() if s}


def _save_at_tp2_dp2_zero1_then_load_at_tp4(rank: int, world: int, ckpt_dir: str) -> dict:
    ps = ParallelState.from_world(2, 2)
    model, optimizer, derived = trained(tiny_cfg("gpt2", *UNTIED, "optim.zero=1", tp=2, dp=2), ps)
    with torch.no_grad():
        logits_tp2 = mappings.gather_from_tensor_parallel_region(model(tokens()), ps.tp_group)
    save_checkpoint(
        ckpt_dir,
        2,
        cfg=model.cfg,
        derived=derived,
        ps=ps,
        model=model,
        optimizer=optimizer,
        tokenizer=BYTES,
    )
    saved = {
        "tp_rank": ps.tp_rank,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "exp_avg": _local_optimizer_state(model, optimizer),
    }
    dist.barrier()
    ps4 = ParallelState.from_world(4, 1)
    cfg4 = tiny_cfg("gpt2", *UNTIED, tp=4)
    model4 = GPT(cfg4, derive(cfg4, 4, vocab_size=VOCAB), ps4).eval()
    optimizer4 = data_parallel_for(model4, cfg4, ps4)
    ckpt = Checkpoint(ckpt_dir)
    restore_model(ckpt, model4)
    restore_optimizer(ckpt, optimizer4, model4)
    with torch.no_grad():
        logits_tp4 = mappings.gather_from_tensor_parallel_region(model4(tokens()), ps4.tp_group)
    return dict(
        saved,
        logits_tp2=logits_tp2[..., :VOCAB],
        logits_tp4=logits_tp4[..., :VOCAB],
        exp_avg_tp4=_local_optimizer_state(model4, optimizer4),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("tp2dp2") / "checkpoints"
    results = run_on_ranks(_save_at_tp2_dp2_zero1_then_load_at_tp4, 4, str(ckpt_dir), timeout=180)
    return ckpt_dir, results


def _full_exp_avg(results, name: str, split_dim: int | None) -> torch.Tensor:
    """The full exp_avg of `name` from the tp=2 x dp=2 ZeRO-1 ranks (each tp rank's state is on
    exactly one dp rank)."""
    blocks = {}
    for result in results[:4]:
        if name in result["exp_avg"]:
            assert result["tp_rank"] not in blocks, "one owner per tp rank"
            blocks[result["tp_rank"]] = result["exp_avg"][name]
    if split_dim is None:
        return blocks[0]
    return torch.cat([blocks[0], blocks[1]], dim=split_dim)


def test_logits_are_the_same_loaded_at_tp4_and_at_tp1(saved):
    ckpt_dir, results = saved
    logits_tp2 = results[0]["logits_tp2"]
    for result in results:
        torch.testing.assert_close(result["logits_tp4"], logits_tp2, rtol=EXACT, atol=FP32_REORDER)
    with torch.no_grad():
        logits_tp1 = load_model(ckpt_dir)(tokens())
    assert logits_tp1.shape == (2, 20, VOCAB)
    torch.testing.assert_close(logits_tp1, logits_tp2, rtol=EXACT, atol=FP32_REORDER)


def _zero_padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    out = tensor.new_zeros((rows,) + tensor.shape[1:])
    out[: min(rows, tensor.shape[0])] = tensor[:rows]
    return out


def test_optimizer_state_reloads_at_tp1_and_tp4_from_zero1_shards(saved):
    ckpt_dir, results = saved
    cfg1 = tiny_cfg("gpt2", *UNTIED)
    model1 = GPT(cfg1, derive(cfg1, 1, vocab_size=VOCAB), ParallelState.single())
    optimizer1 = data_parallel_for(model1, cfg1, ParallelState.single())
    restore_optimizer(Checkpoint(ckpt_dir), optimizer1, model1)
    full = _local_optimizer_state(model1, optimizer1)
    assert set(full) == {n for n, _ in model1.named_parameters()}
    for name, param in model1.named_parameters():
        saved_full = _full_exp_avg(results, name, role(param).tp_split_dim)
        assert full[name].abs().sum() > 0, name
        if name in ("tok_emb.weight", "lm_head.weight"):  # vocab padded to 512 at tp 2, 384 at 1
            assert saved_full.shape[0] == 512 and full[name].shape[0] == 384
            assert saved_full[VOCAB:].abs().sum() == 0 and full[name][VOCAB:].abs().sum() == 0
            assert torch.equal(full[name][:VOCAB], saved_full[:VOCAB]), name
            want_tp4 = _zero_padded(full[name][:VOCAB], 512)
        else:
            assert torch.equal(full[name], saved_full), name
            want_tp4 = full[name]
        for tp_rank, result in enumerate(results):
            want = want_tp4
            split_dim = role(param).tp_split_dim
            if split_dim is not None:
                want = want_tp4.chunk(4, dim=split_dim)[tp_rank]
            assert torch.equal(result["exp_avg_tp4"][name], want), (name, tp_rank)


def test_convert_rewrites_the_shards_at_another_tp_with_the_same_model(saved, tmp_path):
    ckpt_dir, results = saved
    out = tmp_path / "tp4"
    step_dir = convert_checkpoint(str(ckpt_dir), 4, str(out))
    converted = Checkpoint(out)
    assert converted.dir == step_dir and converted.tp == 4 and converted.step == 2
    assert converted.specs["tok_emb.weight"].full_shape == (512, 64)
    assert sorted(p.name for p in step_dir.glob("model_tp*")) == [
        f"model_tp0{r}.safetensors" for r in range(4)
    ]
    with torch.no_grad():
        torch.testing.assert_close(
            load_model(out)(tokens()), load_model(ckpt_dir)(tokens()), rtol=EXACT, atol=EXACT
        )
    back = convert_checkpoint(str(out), 1, str(tmp_path / "tp1"))
    for name in Checkpoint(ckpt_dir).specs:
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(
                Checkpoint(back).full(name, kind), Checkpoint(ckpt_dir).full(name, kind)
            )
    params_tp2 = {r["tp_rank"]: r["params"] for r in results[:2]}
    qkv = torch.cat(
        [params_tp2[0]["blocks.0.attn.qkv.weight"], params_tp2[1]["blocks.0.attn.qkv.weight"]]
    )
    assert torch.equal(Checkpoint(back).full("blocks.0.attn.qkv.weight"), qkv)


# q, k, v biases; q, k norms; a window of 5 in the second block
QWEN_ATTENTION = (
    "model.qkv_bias=true",
    "model.qk_norm=true",
    "model.sliding_window=5",
    "model.full_attention_layers=1",
)


def _save_qwen_attention_at_tp2(rank: int, world: int, ckpt_dir: str) -> torch.Tensor:
    ps = ParallelState.from_world(2, 1)
    model, optimizer, derived = trained(tiny_cfg("llama", *QWEN_ATTENTION, tp=2), ps)
    with torch.no_grad():
        logits = mappings.gather_from_tensor_parallel_region(model(tokens()), ps.tp_group)
    save_checkpoint(
        ckpt_dir, 2, cfg=model.cfg, derived=derived, ps=ps, model=model, optimizer=optimizer
    )
    return logits[..., :VOCAB]


def test_qwen_attention_saved_at_tp2_loads_at_tp1_with_the_same_logits(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    logits_tp2 = run_on_ranks(_save_qwen_attention_at_tp2, 2, str(ckpt_dir), timeout=120)[0]
    model = load_model(ckpt_dir)
    params = dict(model.named_parameters())
    for name in ("attn.qkv.bias", "attn.q_norm.weight", "attn.k_norm.weight"):
        trained = [p for n, p in params.items() if n.endswith(name)]
        assert len(trained) == 2 and all((p - p.mean()).abs().max() > 0 for p in trained), name
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), logits_tp2, rtol=EXACT, atol=FP32_REORDER)
    with pytest.raises(UserError, match="model.qkv_bias"):  # not a Llama without its biases
        export_hf(str(ckpt_dir), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
