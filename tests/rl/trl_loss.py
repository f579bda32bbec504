"""trl's GRPOTrainer._compute_loss, the judge of the RL losses, read from trl's own source
without importing trl (whose import pulls in datasets and accelerate: seconds the suite does
not have), and run on given per-token log-probabilities through a stand-in trainer that
holds the loss's settings (one process, no gradient accumulation)."""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# our loss name -> trl's (loss_type, importance_sampling_level); gspo: trl's documented setup
TRL_SETTINGS = {
    "grpo": ("grpo", "token"),
    "dr_grpo": ("dr_grpo", "token"),
    "dapo": ("dapo", "token"),
    "gspo": ("grpo", "sequence"),
}


@functools.cache
def compute_loss_source() -> str:
    """The source of GRPOTrainer._compute_loss in the installed trl (skips without trl)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        pytest.skip("trl is not installed")
    path = Path(spec.origin).parent / "trainer" / "grpo_trainer.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_compute_loss":
            return ast.unparse(node)
    raise AssertionError(f"{path} has no _compute_loss")


def trl_loss(
    kind: str,
    completion_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    settings: dict,
) -> torch.Tensor:
    """trl's loss of completion log-probabilities [B, C] (padded; completion_mask [B, C]) with
    advantages [B]; settings: clip_low, clip_high, kl_coef, max_completion_length."""
    namespace = {"torch": torch, "nanmin": torch.min, "nanmax": torch.max}
    exec(compute_loss_source(), namespace)  # noqa: S102 (trl's own code, read above)
    loss_type, level = TRL_SETTINGS[kind]
    batch = completion_logps.shape[0]
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            completion_logps,
            torch.zeros_like(completion_logps),
            None,
        ),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        loss_type=loss_type,
        epsilon_low=settings["clip_low"],
        epsilon_high=settings["clip_high"],
        beta=settings["kl_coef"],
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=settings["max_completion_length"],
        accelerator=SimpleNamespace(
            num_processes=1,
            gather=lambda x: x,
            gather_for_metrics=lambda x: x,
            reduce=lambda x, reduction: x,
        ),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(completion_mask, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return namespace["_compute_loss"](trainer, None, inputs)
