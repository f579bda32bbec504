"""What a parameter is to the code around the layers, in one typed place: how it is split over
the tp group and its full shape (initialization, checkpoints, re-sharding, the gradient norm),
the rows of that shape that hold entries (a padded vocabulary), the experts it stacks, and the
group its gradient is summed over before the data-parallel reduction.

The module that makes a parameter sets its role (set_role, or linear.mark_parallel and
moe.experts.mark_experts, which call it); everything else reads it through role(param).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

# The parameter's attribute that holds its role (read and written only here).
_ROLE = "_megatronish_role"


@dataclass(frozen=True)
class ParamRole:
    """One parameter's role. A parameter nobody tagged is replicated over tp, whole, no expert,
    its gradient reduced over the data-parallel group only."""

    full_shape: tuple[int, ...]
    """The unsplit shape (of one expert, for stacked experts)."""
    tp_split_dim: int | None = None
    """The dim split over the tp group; None: replicated on every tp rank."""
    valid_rows: int | None = None
    """Rows of full_shape[0] that hold entries (the vocabulary before padding); None: all."""
    expert_ids: tuple[int, ...] = ()
    """The global ids of the experts stacked in dim 0 (split over ep); empty: not experts."""
    sequence_parallel_grad: bool = False
    """Replicated under sequence parallelism: each tp rank's gradient covers its part of the
    sequence, so it is summed over the tp group first."""
    pipeline_tied: bool = False
    """A copy of the tied embedding on the first or last pipeline stage: its gradient is summed
    over the embedding group (the two stages) first."""
    pipeline_duplicate: bool = False
    """The last stage's copy of a tied embedding: left out of the gradient norm (counted once,
    on the first stage)."""

    init_fill: float | None = None
    """The value initialization fills the parameter with (a norm's weight); None: the
    initialization's own rule."""

    @property
    def is_expert(self) -> bool:
        return bool(self.expert_ids)


def role(param: nn.Parameter) -> ParamRole:
    """param's role (the default one when nothing tagged it)."""
    tagged = getattr(param, _ROLE, None)
    return tagged if tagged is not None else ParamRole(tuple(param.shape))


def set_role(param: nn.Parameter, **fields) -> None:
    """Sets the given fields of param's role, keeping the others."""
    setattr(param, _ROLE, replace(role(param), **fields))


def is_expert(param: nn.Parameter) -> bool:
    """Whether param holds experts (split over ep; its gradient is reduced over the
    expert-data-parallel group)."""
    return role(param).is_expert
