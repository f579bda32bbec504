"""The harness of the fp8 training-curve comparison with torchao (tests/fp8/test_fp8_curve.py,
scripts/fp8_torchao_curve.py): a tiny random transformers Llama, our run started from it
(checkpoint.init_from_hf) in an fp8 recipe with fp32 as the high precision, and two references
trained by torch.optim.AdamW under our schedule on the same batches (tests/hf/curve.py): the
transformers model converted by torchao's convert_to_float8_training (emulate=True; the output
layer kept in fp32, as ours is), and the same model unconverted, in fp32.

`fused=True` gives the fp8 reference one fused query-key-value projection per layer, its rows in
our order (per key-value group: the group's query heads, its key head, its value head), one
torchao Float8Linear whose output q_proj, k_proj and v_proj return slices of. It matters to
every recipe, not only tensorwise (one weight scale for the fused weight): the input-gradient
GEMM sums over the projection's outputs, so a rowwise scale of the output gradient (per token)
and of the weight (per input feature) is the amax over q, k and v together when they are fused,
over each alone when not, as ours are (megatronish.fp8.parts): the separate projections
(fused=False, transformers' own) are the reference of tests/fp8/test_fp8_curve.py, the fused
one a contrast for scripts/fp8_torchao_curve.py.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch
from torch import nn

from megatronish.data import dataset_vocab_size
from megatronish.distributed.layout import ParallelState
from tests.hf.curve import LLAMA_SHAPE, decays, reference_curve, run_settings
from tests.parity import make_config, make_trainer, train_counted

SHAPE = dict(LLAMA_SHAPE, rope_theta=5000.0)  # tests/hf/test_training_curve.py's Llama


def save_tiny_llama(root: Path, dataset: Path, seed: int = 0, key_scale: float = 1.0) -> Path:
    """A tiny random transformers Llama (SHAPE, fp32) saved with save_pretrained in root/llama,
    each layer's k_proj weight multiplied by key_scale (q, k and v of other magnitudes, as a
    trained model's are)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=dataset_vocab_size(dataset), attn_implementation="eager", **SHAPE
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(key_scale)
    model.save_pretrained(root / "llama")
    return root / "llama"


class _FusedQKV(nn.Module):
    """One projection for q, k and v: `linear` [(n + 2k) d, h] in our row order; the output of
    the last input it saw, kept for the three slices q_proj, k_proj and v_proj take of it."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear
        self._seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def output(self, x: torch.Tensor) -> torch.Tensor:
        if self._seen is None or self._seen[0] is not x:
            self._seen = (x, self.linear(x))
        return self._seen[1]


class _Slice(nn.Module):
    """q_proj, k_proj or v_proj of a fused projection: columns `index` of its output (the fused
    module is held outside the module tree, so its weight has one name: self_attn.qkv)."""

    def __init__(self, fused: _FusedQKV, index: torch.Tensor):
        super().__init__()
        self._fused = [fused]
        self.register_buffer("index", index, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].output(x).index_select(-1, self.index)


def fuse_qkv(model: nn.Module, make_linear) -> None:
    """Each layer's q_proj, k_proj and v_proj of a transformers Llama replaced by slices of one
    fused projection self_attn.qkv = make_linear(nn.Linear holding the fused weight)."""
    config = model.config
    n, k = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // n
    per_group = n // k
    rows = {"q": [], "k": [], "v": []}  # the fused rows of each projection's rows, in order
    for g in range(k):
        base = g * (per_group + 2) * d
        rows["q"] += range(base, base + per_group * d)
        rows["k"] += range(base + per_group * d, base + (per_group + 1) * d)
        rows["v"] += range(base + (per_group + 1) * d, base + (per_group + 2) * d)
    for layer in model.model.layers:
        attn = layer.self_attn
        parts = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj}
        assert all(p.bias is None for p in parts.values())
        weight = torch.empty(len(rows["q"]) + 2 * len(rows["k"]), config.hidden_size)
        for name, proj in parts.items():
            weight[rows[name]] = proj.weight.detach()
        linear = nn.Linear(config.hidden_size, weight.shape[0], bias=False)
        with torch.no_grad():
            linear.weight.copy_(weight)
        attn.qkv = _FusedQKV(make_linear(linear))
        for name in parts:
            setattr(attn, f"{name}_proj", _Slice(attn.qkv, torch.tensor(rows[name])))


def float8(recipe: str):
    """make_linear for fuse_qkv: torchao's emulated Float8Linear of `recipe`."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return lambda linear: Float8Linear.from_float(linear, config=config)


def curves(
    hf_dir: Path,
    dataset: Path,
    recipe: str,
    sets: list[str],
    references: dict[str, tuple[bool | None, str]],
) -> dict[str, list[float]]:
    """The losses of our fp8 run ("ours") with extra settings `sets` (train.lr, ...) and of
    each reference {name: (fused, attention)}: the transformers model with that
    attn_implementation (eager, sdpa), converted by torchao with q, k and v fused or not, or
    unconverted in fp32 where fused is None. All on one thread, as a rank computes."""
    import transformers
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fp8 = ["train.precision=fp8", f"train.fp8_recipe={recipe}", "train.fp8_high_precision=fp32"]
    cfg = make_config(1, 1, 1, run_settings(hf_dir) + fp8 + sets, dataset)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
        out = {"ours": train_counted(trainer, cfg.train.steps)[0]}
        decay = decays(trainer, hf_dir, Path(tempfile.mkdtemp(dir=hf_dir.parent)) / "decays")
        for name, (fused, attention) in references.items():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                hf_dir, attn_implementation=attention
            )
            assert model.dtype == torch.float32
            named_decay = decay
            if fused is not None:
                convert_to_float8_training(  # every linear but the output layer's
                    model, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head"
                )
                if fused:
                    fuse_qkv(model, float8(recipe))
                    named_decay = _fused_decay(decay, model)
            out[name] = reference_curve(model, named_decay, cfg, dataset)[0]
    finally:
        torch.set_num_threads(threads)
    return out


def _fused_decay(decay: dict[str, bool], model: nn.Module) -> dict[str, bool]:
    """decay of the unfused names mapped to fuse_qkv's: self_attn.qkv decays as q_proj does."""
    out = {
        n: v
        for n, v in decay.items()
        if not n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
    }
    for name, _ in model.named_parameters():
        if name.endswith("self_attn.qkv.linear.weight"):
            out[name] = decay[name.replace("qkv.linear.weight", "q_proj.weight")]
    return out


def ratios(result: dict[str, list[float]], of: str, fp8: str, fp32: str) -> list[float]:
    """Per step: |result[of] - result[fp8]| / |result[fp8] - result[fp32]|, the distance of
    `of` to the fp8 reference over that reference's own distance to the fp32 one (the
    criterion: every one below 0.1)."""
    return [
        abs(o - r) / max(abs(r - f), 1e-30)
        for o, r, f in zip(result[of], result[fp8], result[fp32])
    ]
