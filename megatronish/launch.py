"""`megatronish launch`: runs `megatronish train` under torchrun (torch.distributed.run)."""

from __future__ import annotations

import os

from torch.distributed import run as torchrun

from megatronish.check import check_config
from megatronish.config import Config
from megatronish.errors import UserError


def launch(
    cfg: Config,
    config_path: str,
    overrides: tuple[str, ...],
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    max_restarts: int,
) -> int:
    """Starts tp * dp * pp / nnodes processes on this node; returns torchrun's exit status."""
    p = cfg.parallel
    world = p.tp * p.pp * (p.dp or 1)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is not valid for --nnodes {nnodes}")
    if world % nnodes:
        raise UserError(f"world size tp * dp * pp = {world} is not divisible by --nnodes {nnodes}")
    check_config(cfg, world)  # a bad config is one line here, not an error from every rank
    nproc = world // nnodes
    # Share this node's cores between its processes (torchrun would otherwise warn and use 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
    ]
    if nnodes > 1:
        args += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--node-rank={node_rank}",
        ]
    else:
        args += ["--standalone"]
    args += ["-m", "megatronish", "train", "--config", config_path]
    for override in overrides:
        args += ["--set", override]
    try:
        torchrun.main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # torchrun's ChildFailedError: the ranks printed their errors
        failures = getattr(exc, "failures", {})
        codes = [f.exitcode for f in failures.values()] if failures else [1]
        return 2 if all(c == 2 for c in codes) else 1
    return 0
