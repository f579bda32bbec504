"""The harness of tests/hf/test_training_curve.py: a run of ours started from a Hugging Face
directory (checkpoint.init_from_hf) on the parity harness (tests/parity.py), and the reference:
the transformers model itself trained with torch.optim.AdamW (and under optim.name muon
torch.optim.Muon on the blocks' projections) on the same global batches, under our settings.

The reference takes from megatronish only what the run is defined by, not how it computes it:
the batches (our loader at dp 1 with the global batch as one micro-batch: the loader gives the
same global batch at every dp and micro-batch size), the learning rate of each step (lr_at, the
documented schedule: linear warmup, then cosine to train.min_lr) and which parameters decay
(param_groups: matrices only), mapped to the transformers model's names through the family's
own tensor mapping. The loss, its gradients, clipping (clip_grad_norm_) and AdamW are torch's
and transformers'. transformers is imported only where the reference needs it: the ranks
import this module.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatronish.data import BatchLoader
from megatronish.hf.family import HEAD
from megatronish.hf.files import CONFIG_JSON, WEIGHTS, read_tensors
from megatronish.hf.importer import read_hf
from megatronish.hf.registry import family_of_model
from megatronish.moe.experts import stored_tensors
from megatronish.optim.optimizer import lr_at, param_groups
from tests.parity import make_config, make_trainer, train_counted

CURVE_STEPS = 20  # the curve against transformers' AdamW: longer than the parity runs'

if TYPE_CHECKING:
    from megatronish.config import Config
    from megatronish.training.trainer import Trainer


def run_settings(hf_dir: Path) -> list[str]:
    """The --set settings of a run that starts from hf_dir: its model.* settings as
    `megatronish import` reads them from config.json, and checkpoint.init_from_hf; with experts,
    no router losses, as the reference's loss (the logits' cross entropy) has none."""
    fields, _ = read_hf(hf_dir)
    sets = [f"checkpoint.init_from_hf={hf_dir}", f"train.steps={CURVE_STEPS}"]
    for key, value in fields.items():
        if dataclasses.is_dataclass(value):  # model.moe
            sets += [f"model.{key}.{k}={_text(v)}" for k, v in vars(value).items() if v is not None]
        elif value is not None:
            sets.append(f"model.{key}={_text(value)}")
    return sets + ["model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0"]


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def train_runs(
    rank: int, world: int, runs: dict, dataset: Path, steps: int | None = None
) -> dict[str, dict]:
    """The losses and gradient norms of each run {name: (tp, pp, settings)} on these ranks
    (dp 1), in turn, over its first `steps` steps (default: all, train.steps)."""
    curves = {}
    for name, (tp, pp, settings) in runs.items():
        trainer = make_trainer(make_config(tp, 1, pp, settings, dataset), world, dataset)
        losses, norms, _ = train_counted(trainer, steps or trainer.cfg.train.steps)
        curves[name] = {"losses": losses, "norms": norms}
    return curves


def decays(trainer: Trainer, hf_dir: Path, scratch: Path) -> dict[str, bool]:
    """Whether our AdamW decays each parameter of the transformers model of hf_dir, by its name
    in the model (which transformers may fuse or rename on loading, as it does experts): our
    param_groups of the trainer's model (tp 1), each of our tensors as a checkpoint names them
    (experts one by one) made 1.0 (decays) or 0.0, mapped to the file's tensors by the family's
    mapping, written to `scratch` with hf_dir's config.json and loaded by transformers."""
    import transformers
    from safetensors.torch import save_file

    model, cfg, derived = trainer.model, trainer.cfg, trainer.setup.derived
    decayed = {id(p) for p in param_groups(model, 1.0)[0]["params"]}
    flags = {
        name: torch.full_like(p if j is None else p[j], float(id(p) in decayed))
        for name, p, j in stored_tensors(model.named_parameters())
    }
    theirs = family_of_model(cfg, derived).to_hf(cfg, derived, flags)
    if not derived.tie_embeddings:
        theirs[HEAD] = flags[HEAD]
    weights = read_tensors(hf_dir)  # the tiny models' files hold no buffers
    assert set(theirs) == set(weights), sorted(set(theirs) ^ set(weights))
    scratch.mkdir()
    shutil.copy(hf_dir / CONFIG_JSON, scratch / CONFIG_JSON)
    save_file(
        {n: torch.full_like(weights[n], _one_flag(n, t)) for n, t in theirs.items()},
        str(scratch / WEIGHTS),
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(scratch)
    return {name: bool(_one_flag(name, p)) for name, p in loaded.named_parameters()}


def _one_flag(name: str, flags: torch.Tensor) -> float:
    """The one value of a tensor of flags (all 1.0 or all 0.0)."""
    assert flags.all() or not flags.any(), f"{name}: decayed in part"
    return float(flags.all())


# The matrices the Muon reference updates: the blocks' projections as transformers stores them.
MUON_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def reference_optimizers(
    named: dict[str, nn.Parameter], decay: dict[str, bool], cfg: Config
) -> list[torch.optim.Optimizer]:
    """torch.optim.AdamW at cfg's betas, eps and weight decay (where `decay` says); under
    optim.name muon, torch.optim.Muon (optim.muon's settings, train.weight_decay) takes the
    MUON_PROJECTIONS' weights out of AdamW's groups."""
    from megatronish.config.optim_checks import muon_settings

    train, optim = cfg.train, cfg.optim
    muon = [n for n in named if optim.name == "muon" and n.endswith(_muon_suffixes())]
    rest = [n for n in named if n not in muon]
    groups = [
        {"params": [named[n] for n in rest if decay[n]], "weight_decay": train.weight_decay},
        {"params": [named[n] for n in rest if not decay[n]], "weight_decay": 0.0},
    ]
    betas = (optim.beta1, optim.beta2)
    optimizers = [torch.optim.AdamW(groups, lr=train.lr, betas=betas, eps=optim.eps)]
    if muon:
        settings = muon_settings(cfg)
        optimizers.append(
            torch.optim.Muon(
                [named[n] for n in muon],
                lr=train.lr,
                weight_decay=train.weight_decay,
                momentum=settings.momentum,
                nesterov=settings.nesterov,
                ns_coefficients=tuple(settings.ns_coefficients),
                eps=settings.eps,
                ns_steps=settings.ns_steps,
                adjust_lr_fn=settings.lr_adjust,
            )
        )
    return optimizers


def _muon_suffixes() -> tuple[str, ...]:
    return tuple(f"{proj}.weight" for proj in MUON_PROJECTIONS)


def reference_curve(
    model: nn.Module,
    decay: dict[str, bool],
    cfg: Config,
    dataset: Path,
    perturb: float = 0.0,
) -> tuple[list[float], list[float]]:
    """The losses and gradient norms (before clipping) of training `model` (a transformers
    causal LM, train mode) for train.steps steps with reference_optimizers (torch.optim.AdamW,
    and torch.optim.Muon under optim.name muon) at lr lr_at(step), gradients clipped by
    clip_grad_norm_ at train.grad_clip; each step's loss the mean token cross entropy over the
    global batch, in one forward. perturb: every gradient multiplied by (1 + perturb u), u
    uniform in [-1, 1) elementwise (a fixed seed), to measure the reference's noise floor."""
    train = cfg.train
    named = dict(model.named_parameters())
    assert set(decay) == set(named), sorted(set(decay) ^ set(named))
    optimizers = reference_optimizers(named, decay, cfg)
    batch_size = train.global_batch_size
    loader = BatchLoader(
        dataset,
        "train",
        seq_len=train.seq_len,
        global_batch_size=batch_size,
        micro_batch_size=batch_size,
        dp_rank=0,
        dp_size=1,
        seed=train.seed,
    )
    assert not loader.masks_loss  # every target counts: the loss is the plain mean
    model.train()
    noise = torch.Generator().manual_seed(1234)
    losses, norms = [], []
    for step in range(1, train.steps + 1):
        batch = loader.next_step()[0]  # [global batch, s + 1]
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        if perturb:
            for p in named.values():
                u = torch.rand(p.shape, generator=noise) * 2 - 1
                p.grad.mul_(1 + perturb * u)
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip).item())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            optimizer.step()
        losses.append(loss.item())
    return losses, norms


# The tiny Llama of the curves (transformers LlamaConfig keys), fp32.
LLAMA_SHAPE = dict(
    hidden_size=40,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def peft_reference(hf_dir: Path, lora: dict, adapters: dict[str, torch.Tensor]) -> nn.Module:
    """The transformers model of hf_dir (fp32, eager attention) under peft's LoRA of `lora`
    (rank, alpha, targets: the experts' as target_parameters), its adapters set to ours ({our
    name: full tensor, one per expert}), train mode."""
    import peft
    import transformers

    from megatronish.hf.peft import peft_tensors
    from megatronish.hf.peft_experts import TARGETS

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    targets = lora["targets"]
    config = peft.LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=0.0,
        target_modules=[t for t in targets if t not in TARGETS] or None,
        target_parameters=[t for t in TARGETS if t in targets] or None,
    )
    model = peft.get_peft_model(base, config)
    named = dict(model.named_parameters())
    wanted = {n for n, p in named.items() if p.requires_grad}
    theirs = {n.replace(".weight", ".default.weight"): t for n, t in peft_tensors(adapters).items()}
    assert set(theirs) == wanted, sorted(set(theirs) ^ wanted)
    with torch.no_grad():
        for name, tensor in theirs.items():
            named[name].copy_(tensor)
    return model
