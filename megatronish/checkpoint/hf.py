"""Hugging Face directories (config.json + model.safetensors) to and from checkpoints.

export: a checkpoint -> a directory that transformers' from_pretrained loads with no custom
code (GPT2LMHeadModel or LlamaForCausalLM, fp32, the real vocab). import: such a directory ->
a checkpoint at step 0 (weights only), or, through checkpoint.init_from_hf, a training run's
starting weights. Only safetensors weights are read (no pickle).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from megatronish.checkpoint.format import TOKENIZER_FILE
from megatronish.checkpoint.hf_map import from_hf_gpt2, from_hf_llama, to_hf
from megatronish.checkpoint.load import inference_config, restore_model
from megatronish.checkpoint.reader import Checkpoint, FullTensors
from megatronish.checkpoint.save import TokenizerInfo, save_checkpoint
from megatronish.config import Config, Derived, MoEConfig, check_values, derive, load_config
from megatronish.errors import UserError, read_json_object
from megatronish.files import follow_umask
from megatronish.paths import require_output_dir

BYTE_TOKENIZER_KEY = "megatronish_tokenizer"  # config.json marker of the byte-level tokenizer


def _require_new_dir(path: Path, flag: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{flag} {path}: exists and is not empty; choose a new directory")


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "a Hugging Face model directory has a config.json")


def model_fields(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Our model.* settings for a Hugging Face config.json; UserError for what we cannot run."""

    def need(key: str, default: Any = KeyError) -> Any:
        value = raw.get(key, default)
        if value is KeyError:
            raise UserError(f"{path}: key '{key}' is missing")
        return value

    kind = raw.get("model_type")
    if kind == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UserError(
                f"{path}: activation_function {act!r}; megatronish's gpt2 uses gelu_new"
            )
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
            raise UserError(
                f"{path}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn unsupported"
            )
        return dict(
            arch="gpt2", n_layer=need("n_layer"), n_head=need("n_head"), n_kv_head=None,
            d_model=need("n_embd"), d_ff=raw.get("n_inner"), vocab_size=need("vocab_size"),
            max_seq_len=need("n_positions", 1024), norm_eps=need("layer_norm_epsilon", 1e-5),
            tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )  # fmt: skip
    if kind in ("llama", "mixtral"):
        if (
            raw.get("hidden_act", "silu") != "silu"
            or raw.get("attention_bias")
            or raw.get("mlp_bias")
        ):
            raise UserError(
                f"{path}: only hidden_act silu without attention or MLP biases is supported"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UserError(f"{path}: rope scaling {rope!r} is not supported; only plain RoPE")
        n_head, d_model = need("num_attention_heads"), need("hidden_size")
        if raw.get("head_dim") not in (None, d_model // n_head):
            raise UserError(
                f"{path}: head_dim {raw['head_dim']} != hidden_size / num_attention_heads"
            )
        return dict(
            arch="llama", n_layer=need("num_hidden_layers"), n_head=n_head,
            n_kv_head=raw.get("num_key_value_heads") or n_head, d_model=d_model,
            d_ff=need("intermediate_size"), vocab_size=need("vocab_size"),
            max_seq_len=need("max_position_embeddings", 2048), norm_eps=need("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            moe=_mixtral_moe(raw, need) if kind == "mixtral" else MoEConfig(),
        )  # fmt: skip
    raise UserError(f"{path}: model_type {kind!r}; megatronish imports gpt2, llama and mixtral")


def _mixtral_moe(raw: dict[str, Any], need) -> MoEConfig:
    """model.moe of a Mixtral config.json: every block's MLP a mixture of experts."""
    return MoEConfig(
        num_experts=need("num_local_experts"),
        top_k=need("num_experts_per_tok"),
        d_ff=need("intermediate_size"),
        aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.01)),
        router="softmax_topk",
    )


def _read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: key 'weight_map' must map tensor names to files")
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
    else:
        raise UserError(f"{hf_dir}: no model.safetensors (only safetensors weights are read)")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update({k: v.float() for k, v in load_file(str(path)).items()})
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path}: not a readable safetensors file ({exc})") from None
    return tensors


def read_hf(hf_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], FullTensors]:
    """(our model.* settings, our full unpadded tensors) of a Hugging Face directory."""
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir}: not a Hugging Face model directory")
    fields = model_fields(_read_json(hf_dir / "config.json"), hf_dir / "config.json")
    hf = _read_tensors(hf_dir)
    try:
        if fields["arch"] == "gpt2":
            hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
            hf = {
                k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))
            }
            ours = from_hf_gpt2(hf, fields["n_layer"], fields["n_head"], fields["tie_embeddings"])
        else:
            hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
            ours = from_hf_llama(
                hf,
                fields["n_layer"],
                fields["n_head"],
                fields["n_kv_head"],
                fields["tie_embeddings"],
                fields["moe"].num_experts,
            )
    except KeyError as exc:
        raise UserError(f"{hf_dir}: tensor {exc} is missing from the weights") from None
    except RuntimeError as exc:
        raise UserError(f"{hf_dir}: tensor shapes do not fit config.json ({exc})") from None
    if hf:
        raise UserError(
            f"{hf_dir}: unexpected tensors {sorted(hf)[:5]}; not a plain {fields['arch']}"
        )
    return fields, FullTensors(ours, hf_dir)


def check_hf_matches(fields: dict[str, Any], cfg: Config, derived: Derived, where: Path) -> None:
    """UserError naming the first model setting of cfg that differs from the HF model's."""
    ours = dict(
        arch=cfg.model.arch, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
        n_kv_head=derived.n_kv_head, d_model=cfg.model.d_model, d_ff=derived.d_ff,
        vocab_size=derived.vocab_size, norm_eps=cfg.model.norm_eps,
        tie_embeddings=derived.tie_embeddings, rope_theta=cfg.model.rope_theta,
    )  # fmt: skip
    theirs = dict(fields, n_kv_head=fields["n_kv_head"] or fields["n_head"])
    theirs["d_ff"] = theirs["d_ff"] or 4 * fields["d_model"]
    if fields["arch"] == "llama":  # experts (Mixtral) or none, and their sizes
        moe, hf_moe = cfg.model.moe, fields["moe"]
        ours["moe.num_experts"], theirs["moe.num_experts"] = moe.num_experts, hf_moe.num_experts
        if hf_moe.num_experts:
            del ours["d_ff"]  # Mixtral has no dense MLP
            ours.update({"moe.top_k": moe.top_k, "moe.d_ff": derived.moe_d_ff})
            theirs.update({"moe.top_k": hf_moe.top_k, "moe.d_ff": hf_moe.d_ff})
    for key, value in ours.items():
        if key == "rope_theta" and fields["arch"] != "llama":
            continue
        if theirs[key] != value:
            raise UserError(
                f"{where / 'config.json'}: the model has {key} {theirs[key]!r}, this config "
                f"{value!r}; set --set model.{key}={theirs[key]}"
            )


def init_from_hf(hf_dir: str, model, cfg: Config, derived: Derived) -> None:
    """Copies a Hugging Face directory's weights into a (tp-sharded) model of the same shape."""
    fields, source = read_hf(hf_dir)
    check_hf_matches(fields, cfg, derived, Path(hf_dir))
    restore_model(source, model)


def _tokenizer_of(hf_dir: Path, raw: dict[str, Any]) -> TokenizerInfo | None:
    from megatronish.data import load_tokenizer_file

    if raw.get(BYTE_TOKENIZER_KEY) == "byte":
        return TokenizerInfo("byte", 256)
    path = hf_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return TokenizerInfo("file", load_tokenizer_file(path).eot_id, path)
    except UserError:
        return None


def import_hf(hf_dir: str, output: str, overrides: tuple[str, ...] = ()) -> tuple[Path, bool]:
    """Writes the weights of a Hugging Face directory as checkpoint `output` (step 0, tp 1;
    model.* from config.json, other keys from the defaults and overrides). Returns (step
    directory, whether a tokenizer was found)."""
    from megatronish.distributed.layout import ParallelState
    from megatronish.model import GPT

    hf_path, out = Path(hf_dir).expanduser(), require_output_dir(output, "--output")
    _require_new_dir(out, "--output")
    fields, source = read_hf(hf_path)
    cfg = load_config(None, overrides)
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    cfg.train.seq_len = min(cfg.train.seq_len, cfg.model.max_seq_len)
    check_values(cfg)
    cfg = inference_config(cfg, fields["vocab_size"], 1)
    derived = derive(cfg, 1, vocab_size=fields["vocab_size"])
    model = GPT(cfg, derived, ParallelState.single())
    restore_model(source, model)
    tokenizer = _tokenizer_of(hf_path, _read_json(hf_path / "config.json"))
    step_dir = save_checkpoint(
        out, 0, cfg=cfg, derived=derived, ps=model.ps, model=model, tokenizer=tokenizer
    )
    return step_dir, tokenizer is not None


def export_hf(checkpoint: str, output: str) -> list[str]:
    """Writes checkpoint `checkpoint` as a Hugging Face directory; returns lines to print."""
    from safetensors.torch import save_file

    out = require_output_dir(output, "--output")
    _require_new_dir(out, "--output")
    ckpt = Checkpoint(checkpoint)
    cfg = inference_config(ckpt.config, ckpt.vocab_size, 1)
    derived = derive(cfg, 1, vocab_size=ckpt.vocab_size)
    info = ckpt.meta.get("tokenizer")
    ckpt.check_in_background()  # every file, while the tensors are read
    ours = {name: ckpt.full(name).float() for name in ckpt.specs}
    ckpt.verify()
    config, tensors = to_hf(cfg, derived, ours, info["eot_id"] if info else None)
    config["torch_dtype"] = "float32"
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    follow_umask(tmp / "model.safetensors")  # safetensors writes 0600: the export is to share
    count = sum(t.numel() for t in tensors.values())
    lines = [
        f"wrote {config['architectures'][0]} ({count:,} parameters, vocab {derived.vocab_size})"
    ]
    if info is not None and info["kind"] == "byte":
        config[BYTE_TOKENIZER_KEY] = "byte"
        lines.append(
            "no tokenizer written: the model is byte-level (ids 0-255 are UTF-8 bytes, 256 is "
            "<|endoftext|>), which transformers has no tokenizer class for"
        )
    elif info is not None and (ckpt.dir / TOKENIZER_FILE).is_file():
        shutil.copyfile(ckpt.dir / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
        eot = ckpt.tokenizer().tokenizer.id_to_token(info["eot_id"])
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.model.max_seq_len,
            "bos_token": eot,
            "eos_token": eot,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        lines.append(f"tokenizer: {TOKENIZER_FILE} (end of text {eot!r})")
    else:
        lines.append("no tokenizer written: the checkpoint records none")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
    lines[0] += f" to {out}"
    return lines
