"""Checks of the training objective's settings (train.objective and train.dpo), each failing with
a UserError that names the key and what is valid."""

from __future__ import annotations

from megatronish.config.rules import require
from megatronish.config.schema import Config, DPOConfig


def dpo_settings(cfg: Config) -> DPOConfig:
    """train.dpo, or its defaults where the config leaves it null."""
    return cfg.train.dpo if cfg.train.dpo is not None else DPOConfig()


def check_objective(cfg: Config) -> None:
    """train.dpo only with train.objective dpo, its values in range, and no multi-token
    prediction under DPO."""
    train = cfg.train
    if train.objective != "dpo":
        require(
            train.dpo is None,
            f"train.dpo: DPO's settings need train.objective dpo (train.objective is "
            f"{train.objective}); valid: train.objective dpo, or no train.dpo keys",
        )
        return
    dpo = dpo_settings(cfg)
    require(dpo.beta > 0, f"train.dpo.beta: {dpo.beta} must be > 0")
    require(
        0 <= dpo.label_smoothing < 0.5,
        f"train.dpo.label_smoothing: {dpo.label_smoothing} must be in [0, 0.5)",
    )
    require(
        dpo.label_smoothing == 0 or dpo.loss == "sigmoid",
        f"train.dpo.label_smoothing: {dpo.label_smoothing} applies to train.dpo.loss sigmoid "
        f"only (train.dpo.loss is {dpo.loss}); valid: 0",
    )
    require(
        cfg.model.mtp_depth == 0,
        f"model.mtp_depth: {cfg.model.mtp_depth}: DPO trains without multi-token prediction; "
        "valid: 0",
    )
