"""Muon: the optimizer (optim.interface) of optim.name muon. Muon updates the blocks' logical
matrices (optim.muon_matrices) with torch.optim.Muon's arithmetic, AdamW the rest.

Per matrix and step, as torch.optim.Muon (torch/optim/_muon.py) computes it: the momentum
B <- B.lerp(g, 1 - mu), the Nesterov update g.lerp(B, mu) (else B), Newton-Schulz in bf16 on
the update transposed if tall and divided by its norm (clamped at eps), the weight decayed
(W <- W (1 - lr wd)) and W <- W - lr' O, with lr' = lr scaled by the matrix's shape
(optim.muon.lr_adjust). The momentum is elementwise: each tp rank keeps its shard's. A matrix
split over tp is orthogonalized whole: its ranks' blocks of the update, in bf16 (the first
thing Newton-Schulz does is that cast, so the gathered matrix is the one a single process
rounds), are all-gathered over the tp group (counted there as all_gather), each rank runs the
iteration on the whole matrix and keeps its own block of the result.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatronish.config import Config
from megatronish.config.optim_checks import muon_settings
from megatronish.distributed import comm
from megatronish.optim.adamw import AdamW
from megatronish.optim.interface import Optimizer, StateSpec
from megatronish.optim.muon_matrices import Matrix, muon_matrices
from megatronish.optim.optimizer import param_groups


class MuonOptimizer(Optimizer):
    """Muon on the blocks' matrices (group "muon": True, with their Matrix list and the tp
    group), AdamW's groups for the rest."""

    name = "muon"
    state = StateSpec(
        moments=("momentum_buffer", "exp_avg", "exp_avg_sq"),
        scalars=("step",),
        whole_only=("momentum_buffer",),
    )

    def param_groups(self, model: nn.Module, weight_decay: float) -> list[dict]:
        matrices = muon_matrices(model)
        taken = {id(m.param) for m in matrices}
        params = list(dict.fromkeys(m.param for m in matrices))
        ps = getattr(model, "ps", None)
        muon = {
            "params": params,
            "weight_decay": weight_decay,
            "muon": True,
            "matrices": matrices,
            "tp_group": None if ps is None else ps.tp_group,
        }
        rest = [
            {**g, "params": [p for p in g["params"] if id(p) not in taken]}
            for g in param_groups(model, weight_decay)
        ]
        return [muon, *rest]

    def build(self, groups: list[dict], cfg: Config) -> Muon:
        optim = cfg.optim
        betas = (optim.beta1, optim.beta2)
        return Muon(groups, cfg.train.lr, muon_settings(cfg), betas, optim.eps)

    def needs_whole(self, model: nn.Module) -> list[nn.Parameter]:
        return list(dict.fromkeys(m.param for m in muon_matrices(model)))


class Muon:
    """The update: Muon over the groups marked "muon", AdamW (optim.adamw) over the others,
    one `state` dict for both (a Muon parameter's: {"momentum_buffer"}, fp32, its shape)."""

    def __init__(self, groups: list[dict], lr: float, settings, betas, eps: float):
        self.settings = settings
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        self.adamw = AdamW([g for g in groups if not g.get("muon")], lr, betas, eps)
        self.adamw.state = self.state
        self.muon_groups = [{**g, "lr": lr} for g in groups if g.get("muon")]
        self.param_groups = self.muon_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self) -> None:
        for group in self.muon_groups:
            self._muon_step(group)
        self.adamw.step()

    def _muon_step(self, group: dict) -> None:
        """One step of the group's matrices: momentum and weight decay per parameter, the
        orthogonalized update per logical matrix."""
        mu, lr = self.settings.momentum, group["lr"]
        updates = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = param.grad
            state = self.state.setdefault(param, {"momentum_buffer": torch.zeros_like(param)})
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - mu)
            updates[param] = grad.lerp(buf, mu) if self.settings.nesterov else buf
            param.mul_(1 - lr * group["weight_decay"])
        for matrix in group["matrices"]:
            if matrix.param in updates:
                self._apply(matrix, updates[matrix.param], lr, group["tp_group"])

    def _apply(self, matrix: Matrix, update: torch.Tensor, lr: float, tp_group) -> None:
        """W <- W - lr' NS(update) on the matrix's block of its parameter."""
        view = matrix.block(update)
        local = view.bfloat16().reshape(-1, view.shape[-1])  # the cast NS begins with
        whole = gather_whole(local, matrix.split_dim, tp_group)
        settings = self.settings
        coefficients = tuple(settings.ns_coefficients)
        ortho = newton_schulz(whole, coefficients, settings.ns_steps, settings.eps)
        target = matrix.block(matrix.param)
        mine = own_block(ortho, matrix.split_dim, tp_group).reshape(target.shape)
        target.add_(mine, alpha=-adjusted_lr(lr, settings.lr_adjust, whole.shape))


def gather_whole(block: torch.Tensor, split_dim: int | None, group) -> torch.Tensor:
    """The whole matrix of which `block` [r, c] is this rank's piece along split_dim, gathered
    over group (ranks in order; split_dim None, or a group of one: block itself)."""
    n = comm.group_size(group)
    if split_dim is None or n == 1:
        return block
    src = block if split_dim == 0 else block.t().contiguous()
    out = src.new_empty(n * src.shape[0], src.shape[1])
    comm.all_gather_into(out, src, group)
    return out if split_dim == 0 else out.t().contiguous()


def own_block(whole: torch.Tensor, split_dim: int | None, group) -> torch.Tensor:
    """This rank's block of whole along split_dim over group (gather_whole's inverse)."""
    n = comm.group_size(group)
    if split_dim is None or n == 1:
        return whole
    return whole.chunk(n, dim=split_dim)[comm.group_rank(group)]


def newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of a 2-D matrix, op for op (bf16)."""
    a, b, c = coefficients
    ortho = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, lr_adjust: str, shape: torch.Size) -> float:
    """lr scaled for a matrix of `shape` (A, B), as torch.optim.Muon's adjust_lr_fn."""
    rows, cols = shape[:2]
    if lr_adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))
