"""Checks of the optimizer's settings (optim.name and optim.muon), each failing with a UserError
that names the key and what is valid."""

from __future__ import annotations

from megatronish.config.rules import require
from megatronish.config.schema import Config, MuonConfig


def muon_settings(cfg: Config) -> MuonConfig:
    """optim.muon, or its defaults where the config leaves it null."""
    return cfg.optim.muon if cfg.optim.muon is not None else MuonConfig()


def check_optimizer(cfg: Config) -> None:
    """optim.muon only with optim.name muon, and its values in range."""
    optim = cfg.optim
    if optim.name != "muon":
        require(
            optim.muon is None,
            f"optim.muon: Muon's settings need optim.name muon (optim.name is {optim.name}); "
            "valid: optim.name muon, or no optim.muon keys",
        )
        return
    muon = muon_settings(cfg)
    require(muon.momentum >= 0, f"optim.muon.momentum: {muon.momentum} must be >= 0")
    require(
        0 < muon.ns_steps < 100,
        f"optim.muon.ns_steps: {muon.ns_steps} is not valid; must be in 1 .. 99",
    )
    require(
        len(muon.ns_coefficients) == 3,
        f"optim.muon.ns_coefficients: {muon.ns_coefficients} is not valid; must be three "
        "numbers [a, b, c]",
    )
    require(muon.eps > 0, f"optim.muon.eps: {muon.eps} must be > 0")
    tau = muon.qk_clip_tau
    require(tau is None or tau > 0, f"optim.muon.qk_clip_tau: {tau} must be > 0 (null: off)")
    require(
        tau is None or not cfg.model.qk_norm or cfg.model.attention == "mla",
        f"optim.muon.qk_clip_tau: {tau} with model.qk_norm true: the q/k RMSNorm undoes any "
        "scaling of the query and key weights, so QK-clip cannot bound the logits (nor do "
        "q/k-normed logits need it); valid: optim.muon.qk_clip_tau null, or model.qk_norm false",
    )
    require(
        tau is None or cfg.model.lora is None,
        f"optim.muon.qk_clip_tau: {tau} with model.lora: QK-clip scales the query and key "
        "weights, which LoRA keeps frozen; valid: optim.muon.qk_clip_tau null, or no model.lora",
    )
