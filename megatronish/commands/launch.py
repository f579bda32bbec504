"""`megatronish launch`: runs `megatronish train` (or, with --command rl, `megatronish rl`) under
torchrun (torch.distributed.run).

The launcher passes SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) on to the ranks (torchrun is told to
leave them alone), which save a checkpoint at the end of their step and exit 0, so the launch
exits 0 as well. A second Ctrl-C aborts the ranks, and the launch exits 130 without waiting for
torchrun to restart anything. (The ranks run in sessions of their own: a terminal's Ctrl-C
reaches only the launcher.)
With --max-restarts, torchrun restarts every rank when one fails, and they resume from the
newest checkpoint.

Several nodes meet at torchrun's c10d rendezvous on --rdzv-endpoint. Each launcher says once
whom it waits for, where and until when (--rdzv-timeout, passed to torchrun as its join
timeout); when the other nodes do not come by then, the launch exits 1 in one line. Node 0's
launcher, on the endpoint's host, hosts the rendezvous store on its port: when another process
holds that port, the launch exits 2 in one line naming it, before torchrun starts (or as
torchrun fails to listen there, if the port was taken in between).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from megatronish.checkpoint.lock import ensure_unlocked
from megatronish.commands.check import check_config
from megatronish.config import Config, world_size_of
from megatronish.errors import RunFailure, UserError
from megatronish.training import faults
from megatronish.training.resume import checkpoint_dir

# torchrun's own signal handling (it stops the ranks), less the signals the launcher forwards.
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"
RDZV_DEFAULT_PORT = 29400  # torchrun's c10d rendezvous, for an endpoint given without a port


def launch(
    cfg: Config,
    config_path: str,
    overrides: tuple[str, ...],
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    max_restarts: int,
    rdzv_timeout: int,
    command: str = "train",
) -> int:
    """Starts tp * cp * dp * pp / nnodes processes of `megatronish <command>` (train or rl) on
    this node; returns torchrun's exit status. With several nodes, waits up to rdzv_timeout
    seconds for all of them."""
    world = world_size_of(cfg)
    _check_launch(cfg, world, nnodes, node_rank, rdzv_timeout, command)
    store_port = store_port_here(rdzv_endpoint) if nnodes > 1 and node_rank == 0 else None
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
    rendezvous = (nnodes, node_rank, rdzv_endpoint, rdzv_timeout, store_port is not None)
    args = torchrun_args(config_path, overrides, nproc, max_restarts, *rendezvous, command)
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
        if store_port is not None and address_in_use(exc):  # taken since store_port_here
            raise UserError(port_in_use(rdzv_endpoint, store_port)) from None
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


def _check_launch(
    cfg: Config, world: int, nnodes: int, node_rank: int, rdzv_timeout: int, command: str
) -> None:
    """The options, the config (and rl's settings) and the checkpoint directory checked before
    any process starts: a mistake is one line here, not an error from every rank."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is not valid for --nnodes {nnodes}")
    if rdzv_timeout < 1:
        raise UserError(f"--rdzv-timeout {rdzv_timeout}: must be at least 1 (seconds)")
    if world % nnodes:
        raise UserError(
            f"world size tp * cp * dp * pp = {world} is not divisible by --nnodes {nnodes}"
        )
    check_config(cfg, world)
    if command == "rl":
        from megatronish.rl.grpo import check_rl

        check_rl(cfg)
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
    hosts_store: bool,
    command: str = "train",
) -> list[str]:
    """torchrun's command line that starts `megatronish <command>` on nproc processes of this node:
    standalone on one node, else a c10d rendezvous at rdzv_endpoint, whose store this node
    hosts when hosts_store (torchrun then fails where it cannot listen on the port, instead of
    dialling whatever holds it)."""
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
            f"--rdzv-conf=join_timeout={rdzv_timeout},read_timeout={rdzv_timeout}"
            + (",is_host=true" if hosts_store else ""),
            f"--node-rank={node_rank}",
        ]
    else:
        args += ["--standalone"]
    args += ["-m", "megatronish", command, "--config", config_path]
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


def store_port_here(endpoint: str) -> int | None:
    """The port of the rendezvous store that node 0's launcher hosts when endpoint's host is
    this machine (None when it is another); a UserError naming the port when another process
    holds it."""
    try:
        host, port = parse_rendezvous_endpoint(endpoint, RDZV_DEFAULT_PORT)
    except ValueError as exc:
        raise UserError(f"--rdzv-endpoint {endpoint}: {exc}") from None
    if not is_this_host(host):
        return None
    if port_taken(port):
        raise UserError(port_in_use(endpoint, port))
    return port


def port_taken(port: int) -> bool:
    """Whether another socket holds port on this host, so that the rendezvous store cannot
    listen there: bound as the store binds it (every address, SO_REUSEADDR), then closed."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:  # another errno (a privileged port): torchrun's to report
            return exc.errno == errno.EADDRINUSE
    return False


def is_this_host(host: str) -> bool:
    """Whether host names an address of this machine (a socket binds to it)."""
    try:
        addresses = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:  # not resolved here
        return False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe, contextlib.suppress(OSError):
            probe.bind(address)
            return True
    return False


def address_in_use(exc: BaseException) -> bool:
    """Whether exc, or an exception it came from, says a socket could not listen because its
    address is in use (torchrun's TCPStore failing to bind the rendezvous port)."""
    current: BaseException | None = exc
    while current is not None:
        if getattr(current, "errno", None) == errno.EADDRINUSE or "EADDRINUSE" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def port_in_use(endpoint: str, port: int) -> str:
    """The line of a launch whose rendezvous port another process holds."""
    return (
        f"launch: --rdzv-endpoint {endpoint}: port {port} is in use on this host by another "
        "process; pick a free port"
    )
