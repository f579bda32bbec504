"""Process groups of a run: one object, built once, passed to whatever needs a group.

Ranks are laid out pp x dp x cp x tp with tp innermost, then cp, then dp, then pp (Megatron's
order): global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, so the ranks
of one tensor-parallel group are adjacent (on one node, where the fast links are), a
context-parallel ring comes next, and pipeline neighbours are dp * cp * tp apart.

The cp ranks of one dp rank hold the same samples (each its zigzag share of every sequence),
so gradients are averaged, and ZeRO-1 shards its state, over the combined dp x cp group
(Megatron folds cp into the data-parallel reduction); its ranks are ordered dp-major, so its
index is dp_rank * cp + cp_rank.

Expert parallelism (ep) is carved out of dp (Megatron's layout): adjacent dp ranks
ep * j .. ep * j + ep - 1 form an ep group, which splits every MoE layer's experts and trades
tokens by all-to-all; ep_rank = dp_rank % ep. The expert weights of one ep rank are replicated
over the dp x cp ranks with the same ep_rank (the expert-data-parallel group, of dp * cp / ep
ranks), over which their gradients are reduced.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatronish.distributed import comm
from megatronish.observe import record

JOIN_S = 300.0
"""The least time joining the process group waits for every rank to start (parallel.timeout_s
bounds the collectives after it): ranks start seconds apart, more on a loaded host or a slow
file system, and a short timeout_s set to find a hang quickly must not fail a healthy start."""


def layout_rank(
    tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int, cp_rank: int = 0, cp: int = 1
) -> int:
    """The global rank at (tp_rank, cp_rank, dp_rank, pp_rank): tp innermost, then cp, dp, pp."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def group_rank_lists(
    tp: int, dp: int, pp: int = 1, cp: int = 1, ep: int = 1
) -> dict[str, tuple[str, list[list[int]]]]:
    """The ranks of every process group of the layout, by the ParallelState field that holds a
    rank's group, each with the kind the flight recorder names it by, in the order the groups
    are created: tp and dp; cp and dp x cp at cp > 1 (and tp x cp at tp > 1 too); ep and
    expert-data-parallel at ep > 1; pp and the tied embedding's at pp > 1."""

    def at(t: int, d: int, p: int, c: int) -> int:  # the rank at tp, dp, pp, cp coordinates
        return layout_rank(t, d, p, tp, dp, c, cp)

    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    lists = {
        "tp_group": ("tp", [[at(t, d, p, c) for t in T] for p in P for d in D for c in C]),
        "dp_group": ("dp", [[at(t, d, p, c) for d in D] for p in P for c in C for t in T]),
    }
    if cp > 1:
        lists["cp_group"] = ("cp", [[at(t, d, p, c) for c in C] for p in P for d in D for t in T])
        lists["dp_cp_group"] = (
            "dp",
            [[at(t, d, p, c) for d in D for c in C] for p in P for t in T],
        )
    if cp > 1 and tp > 1:
        lists["tp_cp_group"] = (
            "cp",
            [[at(t, d, p, c) for c in C for t in T] for p in P for d in D],
        )
    if ep > 1:
        outer, E = range(dp // ep), range(ep)
        lists["ep_group"] = (
            "ep",
            [[at(t, o * ep + e, p, c) for e in E] for p in P for o in outer for c in C for t in T],
        )
        lists["edp_group"] = (
            "dp",
            [[at(t, o * ep + e, p, c) for o in outer for c in C] for p in P for e in E for t in T],
        )
    if pp > 1:
        lists["pp_group"] = ("pp", [[at(t, d, p, c) for p in P] for d in D for c in C for t in T])
        lists["embedding_group"] = (
            "pp",
            [[at(t, d, 0, c), at(t, d, pp - 1, c)] for d in D for c in C for t in T],
        )
    return lists


@dataclass
class ParallelState:
    """The run's process groups, ranks and sizes. With world size 1 and no process group
    initialized, the groups are None and every layer is the plain single-device op."""

    world_size: int
    rank: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device
    tp_ranks: tuple[int, ...] = (0,)
    pp: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    # The first and last stage ranks with this rank's (dp, cp, tp) coordinates, which hold the
    # two copies of tied embeddings (None unless pp > 1 and this rank is on one of those stages).
    embedding_group: dist.ProcessGroup | None = None
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    # The dp x cp ranks with this rank's (tp, pp) coordinates: gradients are averaged over it
    # (the dp group itself when cp is 1).
    dp_cp_group: dist.ProcessGroup | None = None
    # The tp x cp ranks with this rank's (dp, pp) coordinates, which split one micro-batch's
    # activations between them (None unless tp > 1 and cp > 1): fp8 scales are reduced over it.
    tp_cp_group: dist.ProcessGroup | None = None
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None
    # The dp x cp ranks with this rank's (tp, pp, ep_rank) coordinates: expert gradients are
    # reduced over it (dp_cp_group when ep is 1).
    edp_group: dist.ProcessGroup | None = None

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts: dp x cp / ep."""
        return self.dp_cp // self.ep

    @property
    def edp_rank(self) -> int:
        """This rank's index in its expert-data-parallel group: (dp_rank // ep) * cp + cp_rank."""
        return (self.dp_rank // self.ep) * self.cp + self.cp_rank

    def edp_global_rank(self, index: int) -> int:
        """The global rank of index `index` of this rank's expert-data-parallel group."""
        dp_rank = (index // self.cp) * self.ep + self.ep_rank
        return self.global_rank(self.tp_rank, dp_rank, self.pp_rank, index % self.cp)

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes metrics."""
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def dp_cp(self) -> int:
        """Ranks that hold one replica of the weights between them: dp x cp."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in the dp x cp group: dp_rank * cp + cp_rank."""
        return self.dp_rank * self.cp + self.cp_rank

    def global_rank(
        self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int | None = None
    ) -> int:
        """The global rank at these coordinates (cp_rank: this rank's unless given)."""
        cp_rank = self.cp_rank if cp_rank is None else cp_rank
        return layout_rank(tp_rank, dp_rank, pp_rank, self.tp, self.dp, cp_rank, self.cp)

    def dp_cp_global_rank(self, index: int) -> int:
        """The global rank of index `index` of this rank's dp x cp group."""
        return self.global_rank(self.tp_rank, index // self.cp, self.pp_rank, index % self.cp)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """One process, no process group."""
        return cls(1, 0, 1, 1, 0, 0, None, None, torch.device(device))

    @classmethod
    def from_world(cls, tp: int, dp: int, pp: int = 1, cp: int = 1, ep: int = 1) -> ParallelState:
        """Builds the tp, cp, dp, dp x cp, tp x cp, ep, expert-data-parallel and pp groups over the
        initialized default group (every rank calls this, in the same order, because new_group
        is collective)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if tp * cp * dp * pp != world:
            raise ValueError(f"tp * cp * dp * pp = {tp} * {cp} * {dp} * {pp} != world size {world}")
        if ep > 1 and dp % ep:
            raise ValueError(f"ep {ep} does not divide dp {dp}")
        groups: dict[str, dist.ProcessGroup | None] = {}
        tp_ranks: tuple[int, ...] = ()
        for field, (kind, rank_lists) in group_rank_lists(tp, dp, pp, cp, ep).items():
            groups[field] = None
            for ranks in rank_lists:  # every list's group, collectively; this rank's kept
                group = dist.new_group(ranks)
                if rank in ranks:
                    groups[field] = group
                    record.name_group(group, kind, ranks)
                    if field == "tp_group":
                        tp_ranks = tuple(ranks)
        groups.setdefault("dp_cp_group", groups["dp_group"])
        groups.setdefault("edp_group", groups["dp_cp_group"])
        return cls(
            world_size=world,
            rank=rank,
            tp=tp,
            dp=dp,
            tp_rank=rank % tp,
            dp_rank=(rank // (tp * cp)) % dp,
            device=default_device(),
            tp_ranks=tp_ranks,
            pp=pp,
            pp_rank=rank // (tp * cp * dp),
            cp=cp,
            cp_rank=(rank // tp) % cp,
            ep=ep,
            **groups,
        )


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it; 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(
    tp: int, dp: int, timeout_s: float, pp: int = 1, cp: int = 1, ep: int = 1
) -> ParallelState:
    """Joins the process group torchrun described in the environment (NCCL on CUDA, gloo on
    CPU) and builds the run's groups; a single process with world size 1 joins nothing. On
    CPU, groups whose ranks share a host exchange through shared memory (distributed.shm)."""
    world = world_size_from_env()
    if world == 1 and not dist.is_initialized():
        return ParallelState.single(default_device())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(default_device())
        # Joining waits for every rank's start (imports, a slow file system), not a collective:
        # at least JOIN_S, then the collectives' own timeout.
        join = max(timeout_s, JOIN_S)
        dist.init_process_group(backend, timeout=timedelta(seconds=join))
        if join > timeout_s:
            distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    return use_shared_memory(ParallelState.from_world(tp, dp, pp, cp, ep), timeout_s)


def use_shared_memory(ps: ParallelState, timeout_s: float) -> ParallelState:
    """On gloo: the tp, dp, cp and dp x cp groups whose ranks share a host exchange through
    shared memory (distributed.shm) instead of loopback TCP. Every rank calls it. Returns ps."""
    if backend_is_gloo():
        groups = [(ps.tp_group, ps.tp), (ps.dp_group, ps.dp)]
        if ps.cp > 1:
            groups += [(ps.cp_group, ps.cp), (ps.dp_cp_group, ps.dp_cp)]
        if ps.ep > 1:
            groups += [(ps.edp_group, ps.edp)]
        for group, size in groups:
            if size > 1:
                comm.enable_shared_memory(group, timeout_s)
    return ps


def backend_is_gloo() -> bool:
    return dist.is_initialized() and dist.get_backend() == "gloo"


class RNGTracker:
    """Named random streams beside the default one (Megatron's RNG tracker).

    "tensor-parallel" is seeded with seed + 2718 + tp_rank: dropout on activations that are
    split across tp ranks (attention heads) draws different numbers on each rank. The default
    stream (seed) is the same on every tp rank, for dropout on replicated activations.
    """

    TP_OFFSET = 2718

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = device
        self._states: dict[str, torch.Tensor] = {}
        with self._isolated():
            torch.manual_seed(seed + self.TP_OFFSET + tp_rank)
            self._states["tensor-parallel"] = self._get()

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def _isolated(self):
        saved = self._get()
        try:
            yield
        finally:
            self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "tensor-parallel"):
        """Runs the body with stream `name` as the device's RNG, then restores the default."""
        with self._isolated():
            self._set(self._states[name])
            try:
                yield
            finally:
                self._states[name] = self._get()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}
