"""What the ZeRO levels (megatronish.data_parallel) and the checkpoint ask of an optimizer:
its parameter groups, the update it builds over a rank's share of them, the state it keeps per
parameter (saved, re-sharded and loaded by name) and what its update needs whole. One module
per optimizer implements it (optim.adamw); optim.registry finds it by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from megatronish.optim.optimizer import param_groups

if TYPE_CHECKING:
    from torch import nn

    from megatronish.config import Config


@dataclass(frozen=True)
class StateSpec:
    """The state an optimizer keeps per parameter, by name: `moments`, each fp32 and the shape
    of its parameter (under ZeRO a view of one tensor per bucket's shard), and `scalars`, each
    an fp32 scalar tensor (a checkpoint stores one per saved tensor)."""

    moments: tuple[str, ...]
    scalars: tuple[str, ...]
    whole_only: tuple[str, ...] = ()
    """The moments only the parameters the optimizer needs whole have (never a ZeRO shard's)."""

    @property
    def sharded(self) -> tuple[str, ...]:
        """The moments of a piece of a ZeRO bucket's shard."""
        return tuple(k for k in self.moments if k not in self.whole_only)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every state name, moments first (the order a checkpoint's rank file writes them)."""
        return self.moments + self.scalars


class Update(Protocol):
    """An optimizer built over parameter groups: `param_groups` (dicts with "params" and "lr"
    among the group's settings), `state` (parameter -> state by StateSpec name) and step()."""

    param_groups: list[dict]
    state: dict

    def step(self) -> None: ...


class Optimizer(ABC):
    """One optimizer as the ZeRO levels and the checkpoint use it; stateless itself."""

    name: ClassVar[str]
    """The name a checkpoint's metadata records (and a config will choose it by)."""
    state: ClassVar[StateSpec]

    def param_groups(self, model: nn.Module, weight_decay: float) -> list[dict]:
        """Which parameters go in which group, each group a dict with "params" and its
        settings (default: optim.optimizer.param_groups, weight decay on matrices only)."""
        return param_groups(model, weight_decay)

    @abstractmethod
    def build(self, groups: list[dict], cfg: Config) -> Update:
        """The update over groups: the model's, or a rank's share of them (ZeRO-1, 2 and 3
        give it pieces of bucket shards, flat views of parts of parameters)."""

    def needs_whole(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters of model whose update needs all of each on one rank (an elementwise
        optimizer: none); the ZeRO levels keep them out of their buckets, each owned whole by
        one rank of its group (data_parallel.outside.WholeOwners)."""
        return []
