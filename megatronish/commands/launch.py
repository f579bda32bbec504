"""`megatronish launch`: runs `megatronish train` under torchrun (torch.distributed.run).

The launcher passes SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) on to the ranks (torchrun is told to
leave them alone), which save a checkpoint at the end of their step and exit 0, so the launch
exits 0 as well. A second Ctrl-C aborts the ranks, and the launch exits 130 without waiting for
torchrun to restart anything. (The ranks run in sessions of their own: a terminal's Ctrl-C
reaches only the launcher.)
With --max-restarts, torchrun restarts every rank when one fails, and they resume from the
newest checkpoint.

Several nodes meet at torchrun's c10d rendezvous on --rdzv-endpoint. Each launcher says once
whom it waits for, where and until when (--rdzv-timeout, passed to torchrun as its join
timeout); when the other nodes do not come by then, the launch exits 1 in one line.
"""

from __future__ import annotations

import datetime
import os
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError

from megatronish.checkpoint.lock import ensure_unlocked
from megatronish.commands.check import check_config
from megatronish.config import Config, world_size_of
from megatronish.errors import RunFailure, UserError
from megatronish.training import faults
from megatronish.training.resume import checkpoint_dir

# torchrun's own signal handling (it stops the ranks), less the signals the launcher forwards.
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"


def launch(
    cfg: Config,
    config_path: str,
    overrides: tuple[str, ...],
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    max_restarts: int,
    rdzv_timeout: int,
) -> int:
    """Starts tp * cp * dp * pp / nnodes processes on this node; returns torchrun's exit
    status. With several nodes, waits up to rdzv_timeout seconds for all of them."""
    world = world_size_of(cfg)
    _check_launch(cfg, world, nnodes, node_rank, rdzv_timeout)
    nproc = world // nnodes
    # Share this node's cores between its processes (torchrun would otherwise warn and use 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if max_restarts > 0:
        # torchrun's rendezvous store, shared with the ranks by default, keeps the first
        # attempt's keys, so restarted ranks dial the dead ranks' addresses (pytorch#135712):
        # each attempt's rank 0 hosts a fresh store instead.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if nnodes > 1:
        print(waiting_line(nnodes, rdzv_endpoint, rdzv_timeout), file=sys.stderr)
    rendezvous = (nnodes, node_rank, rdzv_endpoint, rdzv_timeout)
    args = torchrun_args(config_path, overrides, nproc, max_restarts, *rendezvous)
    try:
        with faults.forward_stop_signals():
            torchrun.main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except RendezvousTimeoutError:
        raise RunFailure(
            f"launch: not all {nnodes} nodes joined the rendezvous at "
            f"{rdzv_endpoint} within {rdzv_timeout} s (--rdzv-timeout); start `megatronish "
            "launch` on every node with the same --nnodes and --rdzv-endpoint"
        ) from None
    except RendezvousError as exc:  # the endpoint did not answer: node 0 not up, or mistyped
        raise RunFailure(
            f"launch: could not reach the rendezvous at {rdzv_endpoint} within {rdzv_timeout} s "
            f"(--rdzv-timeout): {type(exc).__name__}; start node 0's launch (the endpoint's "
            "host) and check --rdzv-endpoint"
        ) from None
    except Exception as exc:  # torchrun's ChildFailedError: the ranks printed their errors
        failures = getattr(exc, "failures", {})
        codes = {f.exitcode for f in failures.values()} if failures else {1}
        return codes.pop() if codes in ({2}, {130}) else 1  # a user error, or aborted: theirs
    return 0


def _check_launch(cfg: Config, world: int, nnodes: int, node_rank: int, rdzv_timeout: int) -> None:
    """The options, the config and the checkpoint directory checked before any process starts:
    a mistake is one line here, not an error from every rank."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is not valid for --nnodes {nnodes}")
    if rdzv_timeout < 1:
        raise UserError(f"--rdzv-timeout {rdzv_timeout}: must be at least 1 (seconds)")
    if world % nnodes:
        raise UserError(
            f"world size tp * cp * dp * pp = {world} is not divisible by --nnodes {nnodes}"
        )
    check_config(cfg, world)
    if cfg.checkpoint.save:
        ensure_unlocked(checkpoint_dir(cfg))  # another run writing there


def torchrun_args(
    config_path: str,
    overrides: tuple[str, ...],
    nproc: int,
    max_restarts: int,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    rdzv_timeout: int,
) -> list[str]:
    """torchrun's command line that starts `megatronish train` on nproc processes of this node:
    standalone on one node, else a c10d rendezvous at rdzv_endpoint."""
    args = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        f"--signals-to-handle={TORCHRUN_SIGNALS}",
    ]
    if nnodes > 1:
        args += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-conf=join_timeout={rdzv_timeout},read_timeout={rdzv_timeout}",
            f"--node-rank={node_rank}",
        ]
    else:
        args += ["--standalone"]
    args += ["-m", "megatronish", "train", "--config", config_path]
    for override in overrides:
        args += ["--set", override]
    return args


def waiting_line(nnodes: int, endpoint: str, timeout_s: int) -> str:
    """What a launcher of several nodes says once before the rendezvous: whom it waits for,
    where, and when the wait ends (local time)."""
    now = datetime.datetime.now()
    until = now + datetime.timedelta(seconds=timeout_s)
    when = until.strftime("%H:%M:%S" if until.date() == now.date() else "%Y-%m-%d %H:%M:%S")
    return (
        f"launch: waiting for {nnodes - 1} more node(s) at {endpoint} ({nnodes} nodes in all); "
        f"the rendezvous times out at {when} ({timeout_s} s, --rdzv-timeout)"
    )
