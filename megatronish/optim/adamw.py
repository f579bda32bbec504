"""AdamW: the optimizer (optim.interface) that the ZeRO levels use, through PyTorch's fused
kernel."""

from __future__ import annotations

import torch
from torch import nn

from megatronish.config import Config
from megatronish.optim.interface import Optimizer, StateSpec


class AdamWOptimizer(Optimizer):
    """Elementwise: any piece of a parameter updates on its own (needs nothing whole)."""

    name = "adamw"
    state = StateSpec(moments=("exp_avg", "exp_avg_sq"), scalars=("step",))

    def build(self, groups: list[dict], cfg: Config) -> AdamW:
        optim = cfg.optim
        return AdamW(groups, lr=cfg.train.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)


class AdamW:
    """Decoupled-weight-decay Adam through PyTorch's fused kernel (torch._fused_adamw_, CPU and
    CUDA): the update torch.optim.AdamW(fused=True) makes, bit for bit, without torch.optim
    itself, whose wrappers import the compiler stack (about 2 s per process) on first use.

    param_groups: dicts with "params" and "weight_decay". state: parameter -> {"step" (fp32
    scalar tensor), "exp_avg", "exp_avg_sq"}, created at the parameter's first update (a
    parameter without a gradient is skipped, as torch.optim skips it)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float):
        self.param_groups = [{**g, "lr": lr, "betas": betas, "eps": eps} for g in groups]
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}

    def _state(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        state = self.state.get(param)
        if state is None:
            state = self.state[param] = {
                "step": torch.zeros((), dtype=torch.float32, device=param.device),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
        return state

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            by_kind: dict[tuple, list[nn.Parameter]] = {}
            for param in group["params"]:
                if param.grad is not None:
                    by_kind.setdefault((param.device, param.dtype), []).append(param)
            for params in by_kind.values():
                states = [self._state(p) for p in params]
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1)
                beta1, beta2 = group["betas"]
                torch._fused_adamw_(
                    params,
                    [p.grad for p in params],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [],
                    steps,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                )
