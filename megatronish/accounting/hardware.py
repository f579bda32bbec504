"""GPU data sheets (``Device``: dense bf16 peak, memory and its bandwidth, NVLink and network
bandwidth per GPU, GPUs per node), a YAML file describing another device (``load_device``),
and the lookup by name that `plan --gpu NAME` and MFU use (``device_named``).

Every figure is the vendor's, dense (no 2:4 sparsity: dividing by the sparse peak is a common
mistake, Megatron-LM issues 1276 and 1565), one direction of a link. Memory is the HBM's
capacity, which is binary (an "80 GB" part holds 5 x 16 GiB stacks), so plan compares it with
its estimates in GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from megatronish.errors import UserError


@dataclass(frozen=True)
class Device:
    """One accelerator and the node it sits in, as the step-time model reads it."""

    name: str
    peak_tflops: float
    """Dense bf16 (16-bit) matmul peak, TFLOP/s (on a CPU: a measured fp32 matmul rate)."""
    memory_gb: float
    """Device memory, GiB."""
    hbm_tb_s: float
    """Memory bandwidth, TB/s (1e12 bytes/s)."""
    nvlink_gb_s: float
    """One direction of the GPU's links to the GPUs of its node (NVLink; PCIe for cards without
    it), GB/s (1e9 bytes/s)."""
    network_gb_s: float
    """The network bandwidth per GPU to other nodes, one direction, GB/s."""
    gpus_per_node: int
    """GPUs a node holds: groups inside one node use NVLink, the others the network."""

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12


# Sources (datasheets, dense bf16; NVLink is the total / 2 for one direction):
GPUS = {
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOP/s, 141 GB, 4.8 TB/s, NVLink 900 GB/s;
    # DGX H200: 8 x 400 Gb/s ConnectX-7 (one a GPU).
    "H200": Device("H200", 989.0, 141.0, 4.8, 450.0, 50.0, 8),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s, 80 GB, 3.35 TB/s, NVLink 900
    # GB/s; DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 (one a GPU).
    "H100": Device("H100", 989.0, 80.0, 3.35, 450.0, 50.0, 8),
    # H800 (China export variant of H100 SXM): NVLink cut to 400 GB/s.
    "H800": Device("H800", 989.0, 80.0, 3.35, 200.0, 50.0, 8),
    # NVIDIA GH200 Grace Hopper datasheet: 989 TFLOP/s, 96 GB HBM3 at 4 TB/s.
    "GH200": Device("GH200", 989.0, 96.0, 4.0, 450.0, 50.0, 4),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training for 8 GPUs -> 2.25 PFLOP/s dense bf16
    # a GPU, 1,440 GB HBM3e (180 a GPU) at 64 TB/s (8 a GPU), NVLink 5 1.8 TB/s, 8 x 400 Gb/s.
    "B200": Device("B200", 2250.0, 180.0, 8.0, 900.0, 50.0, 8),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s, 2,039 GB/s, NVLink 600
    # GB/s; DGX A100 (Selene): 8 x 200 Gb/s HDR InfiniBand (one a GPU).
    "A100": Device("A100", 312.0, 80.0, 2.039, 300.0, 25.0, 8),
    "A800": Device("A800", 312.0, 80.0, 2.039, 200.0, 25.0, 8),
    # PCIe cards (no NVLink: PCIe 4.0 x16, 32 GB/s; a 100 Gb/s network per GPU assumed).
    # L40S datasheet: 362 TFLOP/s, 48 GB at 864 GB/s.
    "L40S": Device("L40S", 362.0, 48.0, 0.864, 32.0, 12.5, 8),
    # A10G (AWS g5): 24 GB at 600 GB/s.
    "A10G": Device("A10G", 125.0, 24.0, 0.6, 32.0, 12.5, 8),
    # L4 datasheet: 121 TFLOP/s, 24 GB at 300 GB/s.
    "L4": Device("L4", 121.0, 24.0, 0.3, 32.0, 12.5, 8),
    # V100 SXM2 datasheet: 125 TFLOP/s (fp16), 32 GB at 900 GB/s, NVLink 300 GB/s.
    "V100": Device("V100", 125.0, 32.0, 0.9, 150.0, 12.5, 8),
}

# The peaks MFU reads, matched against torch.cuda.get_device_name (in this order).
GPU_PEAK_TFLOPS = {name: gpu.peak_tflops for name, gpu in GPUS.items()}
INTER_NODE_GB_S = GPUS["H100"].network_gb_s
GPUS_PER_NODE = 8

DEVICE_FIELDS = [f.name for f in fields(Device) if f.name != "name"]


def device_named(gpu: str | None) -> Device:
    """The Device of a GPU name (H100 by default; any case) or of a YAML file (a path ending in
    .yaml or .yml) holding every Device field; a UserError naming what is wrong otherwise."""
    if gpu and gpu.lower().endswith((".yaml", ".yml")):
        return load_device(Path(gpu))
    name = (gpu or "H100").upper()
    if name not in GPUS:
        raise UserError(
            f"--gpu {gpu}: unknown GPU; valid: {', '.join(GPUS)}, or a YAML file with "
            f"{', '.join(DEVICE_FIELDS)}"
        )
    return GPUS[name]


def load_device(path: Path) -> Device:
    """A Device from a YAML mapping with every field of ``Device`` (name optional: the file's
    stem). A missing file, a missing or unknown field, or a value that is not a positive number
    is a UserError that names it."""
    import yaml

    if not path.is_file():
        raise UserError(f"--gpu {path}: no such file; give a GPU name or a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"--gpu {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"--gpu {path}: expected a mapping with {', '.join(DEVICE_FIELDS)}")
    missing = [key for key in DEVICE_FIELDS if key not in data]
    if missing:
        raise UserError(
            f"--gpu {path}: missing {', '.join(missing)}; a device file needs "
            f"{', '.join(DEVICE_FIELDS)} (name optional)"
        )
    unknown = sorted(set(data) - set(DEVICE_FIELDS) - {"name"})
    if unknown:
        raise UserError(
            f"--gpu {path}: unknown field {unknown[0]}; valid: name, {', '.join(DEVICE_FIELDS)}"
        )
    values = {}
    for key in DEVICE_FIELDS:
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise UserError(f"--gpu {path}: {key}: {value!r} is not a positive number")
        values[key] = int(value) if key == "gpus_per_node" else float(value)
    return Device(name=str(data.get("name", path.stem)), **values)
