"""The machines a run's GPUs sit in, apart from the GPUs (``Cluster``): GPUs a node, the link
between the GPUs of a node (NVLink through NVSwitch, or PCIe), the network of a node (NICs x
bandwidth, rail-optimized or not), whether the switches reduce in the network (SHARP), and the
oversubscription above a pod; presets with their sources (``CLUSTERS``), a YAML file describing
another (``load_cluster``), and a GPU's default (``default_cluster``: its own node figures on
a non-blocking rail-optimized fabric).

Bandwidths are one direction, GB/s (1e9 bytes/s); a NIC of 400 Gb/s is 50 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from megatronish.accounting.hardware import GPUS, Device
from megatronish.errors import UserError


@dataclass(frozen=True)
class Cluster:
    """Nodes of GPUs and the network between them, as the step-time model reads them."""

    name: str
    gpus_per_node: int
    intra_node_gb_s: float
    """One direction of a GPU's link to the other GPUs of its node (NVLink; PCIe without it)."""
    nvswitch: bool
    """The node's GPUs meet in a switch (every pair at the full link rate); without it (PCIe
    through the host) the GPUs of a node share one link: a collective inside the node gets
    intra_node_gb_s split over the node's concurrent groups."""
    nics_per_node: int
    nic_gb_s: float
    """One direction of one NIC."""
    rail_optimized: bool
    """The same local GPU of every node of a pod hangs off one leaf switch (a rail): a group
    with one rank a node crosses one switch. Without rails every cross-node hop climbs to the
    spine and pays the oversubscription even inside a pod."""
    sharp: bool
    """The switches reduce in the network (NCCL's CollNet / SHARP): an all-reduce across nodes
    sends each byte once instead of 2 (n - 1) / n times."""
    pod_gpus: int
    """GPUs under one non-blocking fabric (a scalable unit); 0: the whole cluster is."""
    oversubscription: float
    """Bandwidth divisor for traffic between pods (1: non-blocking)."""

    @property
    def nic_gb_s_per_gpu(self) -> float:
        return self.nics_per_node * self.nic_gb_s / self.gpus_per_node


CLUSTERS = {
    # Selene (Narayanan et al. 2021, sec. 5; NVIDIA DGX SuperPOD reference architecture): DGX
    # A100, 8 GPUs on NVSwitch at 600 GB/s both ways, 8 x 200 Gb/s HDR InfiniBand a node,
    # rail-optimized full fat tree; SHARP-capable switches, not used by NCCL by default.
    "dgx-a100-selene": Cluster("dgx-a100-selene", 8, 300.0, True, 8, 25.0, True, False, 0, 1.0),
    # DGX H100 datasheet and DGX SuperPOD (H100) reference architecture: NVLink 4 900 GB/s both
    # ways on NVSwitch, 8 x 400 Gb/s NDR ConnectX-7 a node, rail-optimized, non-blocking over
    # scalable units of 32 nodes.
    "dgx-h100": Cluster("dgx-h100", 8, 450.0, True, 8, 50.0, True, False, 0, 1.0),
    # DGX B200 datasheet: NVLink 5 1.8 TB/s both ways on NVSwitch, 8 x 400 Gb/s ConnectX-7.
    "dgx-b200": Cluster("dgx-b200", 8, 900.0, True, 8, 50.0, True, False, 0, 1.0),
    # Grand Teton (OCP) H100 nodes on RoCE as Gangidi et al., "RDMA over Ethernet for Distributed
    # AI Training at Meta Scale" (SIGCOMM 2024) describe them: 8 H100 on NVSwitch, 8 x 400 Gb/s
    # RoCE NICs, rail-optimized AI zones of up to 2,048 GPUs non-blocking, oversubscribed 1:7 at
    # the aggregation layer above them.
    "grand-teton-h100-roce": Cluster(
        "grand-teton-h100-roce", 8, 450.0, True, 8, 50.0, True, False, 2048, 7.0
    ),
    # A PCIe box of 8 L40S (no NVLink; PCIe 4.0 x16 32 GB/s a card through the host) with
    # 2 x 200 Gb/s NICs, not rail-optimized (NVIDIA's L40S server reference configurations).
    "pcie-l40s": Cluster("pcie-l40s", 8, 32.0, False, 2, 25.0, False, False, 0, 1.0),
}

CLUSTER_GPUS = {
    "dgx-a100-selene": "A100",
    "dgx-h100": "H100",
    "dgx-b200": "B200",
    "grand-teton-h100-roce": "H100",
    "pcie-l40s": "L40S",
}
"""The GPU each preset's nodes hold: plan puts only that GPU of accounting.hardware's in them
(a cluster file describes no GPU and takes any)."""

FIELDS = [f.name for f in fields(Cluster) if f.name != "name"]
BOOLS = ("nvswitch", "rail_optimized", "sharp")
INTS = ("gpus_per_node", "nics_per_node", "pod_gpus")


def default_cluster(device: Device) -> Cluster:
    """The cluster a GPU is planned in without --cluster: its own node (gpus_per_node,
    nvlink_gb_s, one NIC of network_gb_s a GPU), switched and rail-optimized, non-blocking."""
    return Cluster(
        f"{device.name} nodes",
        device.gpus_per_node,
        device.nvlink_gb_s,
        True,
        device.gpus_per_node,
        device.network_gb_s,
        True,
        False,
        0,
        1.0,
    )


def cluster_named(name: str | None, device: Device) -> Cluster:
    """The Cluster of a preset name, of a YAML file (a path ending in .yaml or .yml), or the
    device's default (None); a UserError naming what is wrong otherwise."""
    if name is None:
        return default_cluster(device)
    if name.lower().endswith((".yaml", ".yml")):
        return load_cluster(Path(name))
    if name.lower() not in CLUSTERS:
        raise UserError(
            f"--cluster {name}: unknown cluster; valid: {', '.join(CLUSTERS)}, or a YAML file "
            f"with {', '.join(FIELDS)}"
        )
    held = CLUSTER_GPUS[name.lower()]
    if device.name in GPUS and device.name != held:
        others = [k for k, gpu in CLUSTER_GPUS.items() if gpu == device.name]
        raise UserError(
            f"--gpu {device.name} --cluster {name}: {name}'s nodes hold {held} GPUs, not "
            f"{device.name}; valid: --gpu {held}, "
            + (f"--cluster {' or '.join(others)}, " if others else "")
            + "or a cluster YAML file (it takes any GPU)"
        )
    return CLUSTERS[name.lower()]


def cluster_gpu(name: str | None) -> str | None:
    """The GPU a preset cluster's nodes hold (None for no cluster or a cluster file): plan's
    --gpu when --cluster names a preset and --gpu is not given."""
    return CLUSTER_GPUS.get(name.lower()) if name else None


def load_cluster(path: Path) -> Cluster:
    """A Cluster from a YAML mapping with every field of ``Cluster`` (name optional: the file's
    stem): the booleans true or false, the counts positive integers (pod_gpus 0 or more), the
    bandwidths positive numbers, oversubscription at least 1. Anything else is a UserError
    naming the field."""
    import yaml

    where = f"--cluster {path}"
    if not path.is_file():
        raise UserError(f"{where}: no such file; give a cluster name ({', '.join(CLUSTERS)})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping with {', '.join(FIELDS)}")
    unknown = sorted(set(data) - set(FIELDS) - {"name"})
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]}; valid: name, {', '.join(FIELDS)}")
    missing = [key for key in FIELDS if key not in data]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}; a cluster file needs all of them")
    values = {key: _value(where, key, data[key]) for key in FIELDS}
    return Cluster(name=str(data.get("name", path.stem)), **values)


def _value(where: str, key: str, value: object) -> bool | int | float:
    if key in BOOLS:
        if not isinstance(value, bool):
            raise UserError(f"{where}: {key}: {value!r} must be true or false")
        return value
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if key in INTS:
        least = 0 if key == "pod_gpus" else 1
        if not number or value != int(value) or value < least:
            raise UserError(f"{where}: {key}: {value!r} must be an integer >= {least}")
        return int(value)
    least = 1.0 if key == "oversubscription" else 0.0
    if not number or value < least or (least == 0.0 and value == 0):
        what = "a number >= 1" if key == "oversubscription" else "a positive number"
        raise UserError(f"{where}: {key}: {value!r} must be {what}")
    return float(value)
