"""Clusters apart from their GPUs: how many GPUs a node holds, the link between them, the
network a node has (NICs x bandwidth, rail-optimized or not), whether its switches reduce
(SHARP) and what a pod's uplinks are oversubscribed by. ``cluster_named`` reads a preset or a
YAML file for `plan --cluster`; ``on_cluster`` puts a GPU on it (accounting.comm_time reads
the placement from the result); a GPU without --cluster gets ``DEFAULT``'s preset for it.

Presets (vendor reference architectures; one direction of each link):
- selene: DGX A100 SuperPOD (NVIDIA DGX SuperPOD reference architecture, DGX A100): 8 A100 a
  node on NVLink 3 / NVSwitch (300 GB/s a GPU), 8 x 200 Gb/s HDR InfiniBand, rail-optimized
  fat tree, non-blocking.
- dgx-h100: DGX H100 SuperPOD (its reference architecture): NVLink 4 (450 GB/s a GPU), 8 x 400
  Gb/s NDR InfiniBand (ConnectX-7), rail-optimized, non-blocking.
- dgx-b200: DGX B200 datasheet: NVLink 5 (900 GB/s a GPU), 8 x 400 Gb/s ConnectX-7.
- grand-teton-roce: Meta's Grand Teton H100 nodes on RoCE (Gangidi et al., "RDMA over
  Ethernet for Distributed Training at Meta Scale", SIGCOMM 2024): 8 x 400 Gb/s a node, rail-
  optimized AI zones of a non-blocking two-tier Clos (taken as 256 nodes), the aggregation
  layer between zones oversubscribed 1:7.
- l40s-pcie: a PCIe 4.0 server of 8 L40S (no NVLink: 32 GB/s x16 a GPU) with 2 x 200 Gb/s
  Ethernet NICs, not rail-optimized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

from megatronish.accounting.hardware import Device
from megatronish.errors import UserError


@dataclass(frozen=True)
class Cluster:
    """The nodes and network a GPU is placed in."""

    name: str
    gpus_per_node: int
    nvlink_gb_s: float
    """Intra-node bandwidth a GPU, one direction, GB/s (NVLink, or PCIe without it)."""
    nics_per_node: int
    nic_gb_s: float
    """One NIC's bandwidth, one direction, GB/s (400 Gb/s: 50)."""
    rail_optimized: bool = True
    sharp: bool = False
    pod_nodes: int = 0
    """Nodes of one non-blocking pod (0: the whole cluster is one)."""
    oversubscription: float = 1.0


CLUSTERS = {
    "selene": Cluster("selene", 8, 300.0, 8, 25.0),
    "dgx-h100": Cluster("dgx-h100", 8, 450.0, 8, 50.0),
    "dgx-b200": Cluster("dgx-b200", 8, 900.0, 8, 50.0),
    "grand-teton-roce": Cluster("grand-teton-roce", 8, 450.0, 8, 50.0, True, False, 256, 7.0),
    "l40s-pcie": Cluster("l40s-pcie", 8, 32.0, 2, 25.0, False),
}
DEFAULT = {
    "A100": "selene",
    "H100": "dgx-h100",
    "H200": "dgx-h100",
    "B200": "dgx-b200",
    "L40S": "l40s-pcie",
}
NUMBERS = (
    "gpus_per_node",
    "nvlink_gb_s",
    "nics_per_node",
    "nic_gb_s",
    "pod_nodes",
    "oversubscription",
)
FLAGS = ("rail_optimized", "sharp")


def on_cluster(device: Device, cluster: Cluster) -> Device:
    """`device` placed in `cluster`'s nodes and network."""
    return dataclasses.replace(
        device,
        gpus_per_node=cluster.gpus_per_node,
        nvlink_gb_s=cluster.nvlink_gb_s,
        network_gb_s=cluster.nics_per_node * cluster.nic_gb_s / cluster.gpus_per_node,
        nics_per_node=cluster.nics_per_node,
        sharp=cluster.sharp,
        pod_nodes=cluster.pod_nodes,
        oversubscription=cluster.oversubscription,
        rail_optimized=cluster.rail_optimized,
    )


def default_cluster(device: Device) -> Device:
    """A GPU on the preset cluster its vendor builds (DEFAULT), else as its fields say."""
    name = DEFAULT.get(device.name)
    return on_cluster(device, CLUSTERS[name]) if name else device


def cluster_named(text: str) -> Cluster:
    """A preset by name (any case) or a YAML file (.yaml or .yml) with every field but name
    (rail_optimized, sharp, pod_nodes and oversubscription optional); a UserError naming what
    is wrong otherwise."""
    if not text.lower().endswith((".yaml", ".yml")):
        if text.lower() not in CLUSTERS:
            raise UserError(
                f"--cluster {text}: unknown cluster; valid: {', '.join(CLUSTERS)}, or a YAML "
                f"file with {', '.join(NUMBERS[:4])}"
            )
        return CLUSTERS[text.lower()]
    return _load(Path(text))


def _load(path: Path) -> Cluster:
    import yaml

    if not path.is_file():
        raise UserError(f"--cluster {path}: no such file; give a cluster name or a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"--cluster {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    required = NUMBERS[:4]
    if not isinstance(data, dict) or any(key not in data for key in required):
        missing = [key for key in required if not isinstance(data, dict) or key not in data]
        raise UserError(
            f"--cluster {path}: missing {', '.join(missing)}; a cluster file needs "
            f"{', '.join(required)}"
        )
    valid = {f.name for f in fields(Cluster)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise UserError(
            f"--cluster {path}: unknown field {unknown[0]}; valid: "
            f"{', '.join(f.name for f in fields(Cluster))}"
        )
    values = {"name": str(data.get("name", path.stem))}
    for key in NUMBERS:
        if key not in data:
            continue
        value = data[key]
        low = 0 if key == "pod_nodes" else 1 if key == "oversubscription" else 1e-12
        if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
            raise UserError(f"--cluster {path}: {key}: {value!r} must be a number >= {low:g}")
        integer = key in ("gpus_per_node", "nics_per_node", "pod_nodes")
        values[key] = int(value) if integer else float(value)
    for key in FLAGS:
        if key in data:
            if not isinstance(data[key], bool):
                raise UserError(f"--cluster {path}: {key}: {data[key]!r} must be true or false")
            values[key] = data[key]
    return Cluster(**values)
