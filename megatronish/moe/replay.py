"""Routing replay: each token's chosen experts recorded where a rollout is generated, and forced
where the trainer computes the same tokens again, so that training routes as the rollout did.

Recording: inside `recording(tape)`, every MoE layer's forward adds its tokens' experts (int64
[T, k], best first) to the tape under its layer index, in the order of the forwards (generate:
the prompt, then one token a step). `Tape.routes()` lays them out as int64 [n_moe, T_all, k]
(n_moe the model's MoE layers, in order).

Replaying: a micro-batch's documents are `RoutedDocuments`, whose routes int64
[b, s / cp, n_moe, k] (this cp rank's shard, as its tokens) name each token's experts per MoE
layer, -1 for a token routed as the router chooses. The documents travel with the micro-batch
through the pipeline stages and into activation recompute, so a recomputed or pipelined
forward forces the same experts. The router's top-k is replaced by the forced experts; their
combine weights are still computed from the router's scores (moe.router.route).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatronish.context.documents import Documents


@dataclass(frozen=True)
class RoutedDocuments(Documents):
    """Documents whose tokens' experts are forced: routes int64 [b, s / cp, n_moe, k], -1
    free."""

    routes: torch.Tensor | None = None


class Tape:
    """The experts each MoE layer chose, by layer index, in the order of the forwards."""

    def __init__(self, moe_layers: tuple[int, ...]):
        self.moe_layers = moe_layers
        self.pieces: dict[int, list[torch.Tensor]] = {layer: [] for layer in moe_layers}

    def add(self, layer: int, experts: torch.Tensor) -> None:
        k = experts.shape[-1]
        self.pieces[layer].append(experts.detach().to("cpu", torch.int64).reshape(-1, k))

    def routes(self) -> torch.Tensor:
        """int64 [n_moe, T_all, k]: every recorded token's experts per MoE layer."""
        return torch.stack([torch.cat(self.pieces[layer]) for layer in self.moe_layers])


_TAPE: list[Tape | None] = [None]


@contextlib.contextmanager
def recording(tape: Tape):
    """Every MoE layer's forward inside adds its tokens' experts to tape."""
    _TAPE[0] = tape
    try:
        yield tape
    finally:
        _TAPE[0] = None


def record(layer: int, experts: torch.Tensor) -> None:
    """Adds a layer's experts [T, k] to the tape being recorded, if any."""
    if _TAPE[0] is not None and layer in _TAPE[0].pieces:
        _TAPE[0].add(layer, experts)


def forced(documents: Documents | None, moe_index: int | None) -> torch.Tensor | None:
    """The forced experts [b, s / cp, k] of MoE layer moe_index (its place among the model's
    MoE layers) in these documents, or None where nothing is forced."""
    routes = getattr(documents, "routes", None)
    if routes is None or moe_index is None:
        return None
    return routes[..., moe_index, :]
