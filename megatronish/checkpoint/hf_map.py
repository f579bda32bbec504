"""The mapping between our parameters and Hugging Face's GPT2LMHeadModel / LlamaForCausalLM /
MixtralForCausalLM (a llama whose every MLP is a mixture of experts: our router is Mixtral's
block_sparse_moe.gate, expert e's gate, down and up its experts.<e>.w1, w2 and w3, the names
of the Hub's Mixtral checkpoints).

Shapes: h d_model, n query heads, k kv heads, d head dim, f d_ff, V the real vocab.
Ours: qkv [(n + 2k) d, h] laid out by kv group (each group: its n/k query heads, its key head,
its value head); every linear weight [out, in]. HF GPT-2 uses Conv1D, weights [in, out], and
c_attn is [h, q (n d) | k (n d) | v (n d)]; HF Llama has separate q_proj [n d, h], k_proj and
v_proj [k d, h]. Both number query head j as ours does (its kv head is j // (n / k)), and our
RoPE pairs dims i and i + d/2 as HF's rotate_half does, so no row permutation beyond the
grouping is needed. All tensors here are full and unpadded (V rows).
"""

from __future__ import annotations

import torch

from megatronish.config import Config, Derived
from megatronish.errors import UserError

Tensors = dict[str, torch.Tensor]


def split_qkv(fused: torch.Tensor, n: int, k: int, d: int) -> tuple[torch.Tensor, ...]:
    """Our grouped qkv rows [(n + 2k) d, ...] -> (q [n d, ...], k [k d, ...], v [k d, ...])."""
    rest = fused.shape[1:]
    grouped = fused.reshape(k, n // k + 2, d, *rest)
    q = grouped[:, : n // k].reshape(n * d, *rest)
    return q, grouped[:, n // k].reshape(k * d, *rest), grouped[:, n // k + 1].reshape(k * d, *rest)


def merge_qkv(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n: int, k: int, d: int):
    """The inverse of split_qkv."""
    rest = q.shape[1:]
    parts = [
        q.reshape(k, n // k, d, *rest),
        key.reshape(k, 1, d, *rest),
        value.reshape(k, 1, d, *rest),
    ]
    return torch.cat(parts, dim=1).reshape((n + 2 * k) * d, *rest).contiguous()


# Our expert weight -> its name in the Hub's Mixtral checkpoints (w1 gate, w2 down, w3 up).
MIXTRAL_EXPERT = (("gate", "w1"), ("down", "w2"), ("up", "w3"))


def mixtral_config(cfg: Config, derived: Derived) -> dict:
    """The config.json keys that make a llama export a MixtralForCausalLM; UserError for an
    MoE that Mixtral cannot express."""
    moe = cfg.model.moe
    for bad, key, valid in (
        (moe.every != 1, "model.moe.every", "1 (an MoE MLP in every block)"),
        (moe.shared_expert, "model.moe.shared_expert", "false"),
    ):
        if bad:
            raise UserError(
                f"{key}: Mixtral (export --format hf) has no equivalent of "
                f"{getattr(moe, key.rpartition('.')[2])!r}; valid for export: {valid}"
            )
    # topk_softmax gives the same weights as Mixtral's softmax, top-k, renormalize.
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": derived.moe_d_ff,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def to_hf(cfg: Config, derived: Derived, ours: Tensors, eot_id: int | None) -> tuple[dict, Tensors]:
    """(config.json content, HF state dict) of our full unpadded tensors."""
    m = cfg.model
    n, k, d = m.n_head, derived.n_kv_head, derived.head_dim
    tied = derived.tie_embeddings
    out: Tensors = {}
    if m.arch == "gpt2":
        out["transformer.wte.weight"] = ours["tok_emb.weight"]
        out["transformer.wpe.weight"] = ours["pos_emb.weight"]
        for i in range(m.n_layer):
            src, dst = f"blocks.{i}.", f"transformer.h.{i}."
            for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
                out[dst + b + ".weight"] = ours[src + a + ".weight"]
                out[dst + b + ".bias"] = ours[src + a + ".bias"]
            qkv_w = split_qkv(ours[src + "attn.qkv.weight"], n, k, d)
            out[dst + "attn.c_attn.weight"] = _t(torch.cat(qkv_w))
            out[dst + "attn.c_attn.bias"] = torch.cat(
                split_qkv(ours[src + "attn.qkv.bias"], n, k, d)
            )
            for a, b in (
                ("attn.proj", "attn.c_proj"),
                ("mlp.up", "mlp.c_fc"),
                ("mlp.down", "mlp.c_proj"),
            ):
                out[dst + b + ".weight"] = _t(ours[src + a + ".weight"])
                out[dst + b + ".bias"] = ours[src + a + ".bias"]
        out["transformer.ln_f.weight"] = ours["norm_f.weight"]
        out["transformer.ln_f.bias"] = ours["norm_f.bias"]
        config = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": derived.vocab_size,
            "n_positions": m.max_seq_len,
            "n_ctx": m.max_seq_len,
            "n_embd": m.d_model,
            "n_layer": m.n_layer,
            "n_head": n,
            "n_inner": derived.d_ff,
            "activation_function": "gelu_new",
            "resid_pdrop": m.dropout,
            "embd_pdrop": m.dropout,
            "attn_pdrop": m.dropout,
            "layer_norm_epsilon": m.norm_eps,
            "scale_attn_weights": True,
        }
    else:
        out["model.embed_tokens.weight"] = ours["tok_emb.weight"]
        for i in range(m.n_layer):
            src, dst = f"blocks.{i}.", f"model.layers.{i}."
            out[dst + "input_layernorm.weight"] = ours[src + "norm1.weight"]
            out[dst + "post_attention_layernorm.weight"] = ours[src + "norm2.weight"]
            q, key, value = split_qkv(ours[src + "attn.qkv.weight"], n, k, d)
            out[dst + "self_attn.q_proj.weight"] = q.contiguous()
            out[dst + "self_attn.k_proj.weight"] = key.contiguous()
            out[dst + "self_attn.v_proj.weight"] = value.contiguous()
            out[dst + "self_attn.o_proj.weight"] = ours[src + "attn.proj.weight"]
            if i in derived.moe_layers:
                out[dst + "block_sparse_moe.gate.weight"] = ours[src + "mlp.router.weight"]
                for e in range(m.moe.num_experts):
                    for a, b in MIXTRAL_EXPERT:
                        key = f"block_sparse_moe.experts.{e}.{b}.weight"
                        out[dst + key] = ours[src + f"mlp.experts.{e}.{a}.weight"]
                continue
            for a in ("gate", "up", "down"):
                out[dst + f"mlp.{a}_proj.weight"] = ours[src + f"mlp.{a}.weight"]
        out["model.norm.weight"] = ours["norm_f.weight"]
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": derived.vocab_size,
            "hidden_size": m.d_model,
            "intermediate_size": derived.d_ff,
            "num_hidden_layers": m.n_layer,
            "num_attention_heads": n,
            "num_key_value_heads": k,
            "head_dim": d,
            "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": m.dropout,
        }
        if derived.moe_layers:
            config.update(mixtral_config(cfg, derived))
    if not tied:
        out["lm_head.weight"] = ours["lm_head.weight"]
    config["tie_word_embeddings"] = tied
    if eot_id is not None:
        config["bos_token_id"] = config["eos_token_id"] = eot_id
    return config, {name: t.contiguous() for name, t in out.items()}


def from_hf_gpt2(hf: Tensors, n_layer: int, n_head: int, tied: bool) -> Tensors:
    """Our tensors of a GPT2LMHeadModel state dict (keys without the 'transformer.' prefix)."""
    ours: Tensors = {"tok_emb.weight": hf.pop("wte.weight"), "pos_emb.weight": hf.pop("wpe.weight")}
    d = ours["tok_emb.weight"].shape[1] // n_head
    for i in range(n_layer):
        src, dst = f"h.{i}.", f"blocks.{i}."
        for a, b in (("ln_1", "norm1"), ("ln_2", "norm2")):
            ours[dst + b + ".weight"] = hf.pop(src + a + ".weight")
            ours[dst + b + ".bias"] = hf.pop(src + a + ".bias")
        q, key, value = hf.pop(src + "attn.c_attn.weight").t().chunk(3)
        ours[dst + "attn.qkv.weight"] = merge_qkv(q, key, value, n_head, n_head, d)
        qb, kb, vb = hf.pop(src + "attn.c_attn.bias").chunk(3)
        ours[dst + "attn.qkv.bias"] = merge_qkv(qb, kb, vb, n_head, n_head, d)
        for a, b in (
            ("attn.c_proj", "attn.proj"),
            ("mlp.c_fc", "mlp.up"),
            ("mlp.c_proj", "mlp.down"),
        ):
            ours[dst + b + ".weight"] = _t(hf.pop(src + a + ".weight"))
            ours[dst + b + ".bias"] = hf.pop(src + a + ".bias")
    ours["norm_f.weight"] = hf.pop("ln_f.weight")
    ours["norm_f.bias"] = hf.pop("ln_f.bias")
    _take_head(hf, ours, tied)
    return ours


def _take_head(hf: Tensors, ours: Tensors, tied: bool) -> None:
    """Moves lm_head.weight across when the model is untied (a tied one may omit it)."""
    head = hf.pop("lm_head.weight", None)
    if not tied:
        if head is None:
            raise KeyError("lm_head.weight")
        ours["lm_head.weight"] = head


def from_hf_llama(
    hf: Tensors, n_layer: int, n_head: int, n_kv_head: int, tied: bool, num_experts: int = 0
) -> Tensors:
    """Our tensors of a LlamaForCausalLM state dict, or of a MixtralForCausalLM one (every
    block a mixture of num_experts experts)."""
    ours: Tensors = {"tok_emb.weight": hf.pop("model.embed_tokens.weight")}
    for i in range(n_layer):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        ours[dst + "norm1.weight"] = hf.pop(src + "input_layernorm.weight")
        ours[dst + "norm2.weight"] = hf.pop(src + "post_attention_layernorm.weight")
        q = hf.pop(src + "self_attn.q_proj.weight")
        d = q.shape[0] // n_head
        key, value = (
            hf.pop(src + "self_attn.k_proj.weight"),
            hf.pop(src + "self_attn.v_proj.weight"),
        )
        ours[dst + "attn.qkv.weight"] = merge_qkv(q, key, value, n_head, n_kv_head, d)
        ours[dst + "attn.proj.weight"] = hf.pop(src + "self_attn.o_proj.weight")
        if num_experts:
            ours[dst + "mlp.router.weight"] = hf.pop(src + "block_sparse_moe.gate.weight")
            for e in range(num_experts):
                for a, b in MIXTRAL_EXPERT:
                    key = f"block_sparse_moe.experts.{e}.{b}.weight"
                    ours[dst + f"mlp.experts.{e}.{a}.weight"] = hf.pop(src + key)
            continue
        for a in ("gate", "up", "down"):
            ours[dst + f"mlp.{a}.weight"] = hf.pop(src + f"mlp.{a}_proj.weight")
    ours["norm_f.weight"] = hf.pop("model.norm.weight")
    _take_head(hf, ours, tied)
    return ours
