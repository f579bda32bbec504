"""GPU data sheets (``Device``: dense bf16 and fp8 peaks, memory and its bandwidth, NVLink and
network bandwidth per GPU, GPUs per node, and what shapes its GEMMs: streaming multiprocessors,
the output tile of its large bf16 GEMM kernels, the share of the peak those reach), a YAML
file describing another device (``load_device``), and the lookup by name that `plan --gpu
NAME` and MFU use (``device_named``). The network a node sits on is accounting.cluster's.

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
    fp8_peak_tflops: float | None = None
    """Dense fp8 matmul peak, TFLOP/s; None where the GPU has no fp8 tensor cores."""
    sms: int = 0
    """Streaming multiprocessors: a GEMM's output tiles run in waves of this many (0: no wave
    quantization, as on a CPU)."""
    tile_m: int = 128
    tile_n: int = 128
    """The output tile (rows x columns) of the GPU generation's large bf16 GEMM kernels."""
    gemm_fraction: float | None = None
    """Of the dense peak, what a large, well-quantized bf16 GEMM sustains (None: the
    Efficiency's gemm_fraction)."""
    attention_fraction: float | None = None
    """Of the dense peak, what its fused attention kernels reach (None: the Efficiency's)."""
    nics_per_node: int = 0
    """Network adapters a node holds, each of network_gb_s x gpus_per_node / nics_per_node
    (0: one a GPU). Set with the rest of the network by accounting.cluster."""
    sharp: bool = False
    """Whether the network's switches reduce (SHARP): an all-reduce across nodes then sends
    its payload once a rank instead of 2 (n - 1) / n of it."""
    pod_nodes: int = 0
    """Nodes under one non-blocking pod of the network (0: the whole cluster)."""
    oversubscription: float = 1.0
    """Of the network above a pod (or of every link between nodes when not rail-optimized):
    a group's bandwidth is divided by it."""
    rail_optimized: bool = True
    """Whether the i-th NIC of every node shares a leaf switch (a rail)."""

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12


# Hopper and Blackwell GEMMs: CUTLASS's and cuBLAS's warp-specialized kernels use 128 x 256
# output tiles for large bf16 GEMMs (CUTLASS 3 "Efficient GEMM" and its Hopper examples);
# Ampere and older 128 x 128 (NVIDIA's "Matrix Multiplication Background" guide). What large
# bf16 GEMMs sustain: A100 about 80% of the peak (that guide's A100 figures; Bekman's "Maximum
# Achievable Matmul FLOPS" table: 268 of 312 at its best shape); Hopper's tensor cores outrun
# its power budget, so sustained GEMMs run below the 1,830 MHz the peak assumes: about 70%
# (660-720 of 989 TFLOP/s at transformer shapes in NVIDIA's and others' published cuBLAS and
# Transformer Engine measurements; 792 at the best shape the MAMF search finds). Fused attention
# of the FlashAttention-2 kind reaches only 35% of Hopper's peak (Shah et al. 2024,
# "FlashAttention-3", abstract and figures), against 50% on A100 (roofline.Efficiency).
HOPPER = {
    "sms": 132,
    "tile_m": 128,
    "tile_n": 256,
    "gemm_fraction": 0.70,
    "attention_fraction": 0.35,
}

# Sources (datasheets, dense bf16 and fp8, no sparsity; NVLink is the total / 2 for one
# direction):
GPUS = {
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOP/s bf16, 1,979 fp8, 141 GB,
    # 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8 x 400 Gb/s ConnectX-7 (one a GPU).
    "H200": Device("H200", 989.0, 141.0, 4.8, 450.0, 50.0, 8, 1979.0, **HOPPER),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16, 1,979 fp8, 80 GB,
    # 3.35 TB/s, NVLink 900 GB/s; DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 (one a GPU).
    "H100": Device("H100", 989.0, 80.0, 3.35, 450.0, 50.0, 8, 1979.0, **HOPPER),
    # H800 (China export variant of H100 SXM): NVLink cut to 400 GB/s.
    "H800": Device("H800", 989.0, 80.0, 3.35, 200.0, 50.0, 8, 1979.0, **HOPPER),
    # NVIDIA GH200 Grace Hopper datasheet: 989 TFLOP/s, 1,979 fp8, 96 GB HBM3 at 4 TB/s.
    "GH200": Device("GH200", 989.0, 96.0, 4.0, 450.0, 50.0, 4, 1979.0, **HOPPER),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training for 8 GPUs -> 4.5 PFLOP/s dense fp8
    # and 2.25 dense bf16 a GPU, 1,440 GB HBM3e (180 a GPU) at 64 TB/s (8 a GPU), NVLink 5
    # 1.8 TB/s, 8 x 400 Gb/s; 148 SMs (NVIDIA Blackwell architecture technical brief).
    "B200": Device("B200", 2250.0, 180.0, 8.0, 900.0, 50.0, 8, 4500.0, **{**HOPPER, "sms": 148}),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s, 2,039 GB/s, NVLink 600
    # GB/s, 108 SMs, no fp8; DGX A100 (Selene): 8 x 200 Gb/s HDR InfiniBand (one a GPU).
    "A100": Device("A100", 312.0, 80.0, 2.039, 300.0, 25.0, 8, None, 108),
    "A800": Device("A800", 312.0, 80.0, 2.039, 200.0, 25.0, 8, None, 108),
    # PCIe cards (no NVLink: PCIe 4.0 x16, 32 GB/s; a 100 Gb/s network per GPU assumed).
    # L40S datasheet: 362 TFLOP/s bf16, 733 fp8, 48 GB at 864 GB/s, 142 SMs.
    "L40S": Device("L40S", 362.0, 48.0, 0.864, 32.0, 12.5, 8, 733.0, 142),
    # A10G (AWS g5): 24 GB at 600 GB/s, 80 SMs.
    "A10G": Device("A10G", 125.0, 24.0, 0.6, 32.0, 12.5, 8, None, 80),
    # L4 datasheet: 121 TFLOP/s bf16, 242.5 fp8, 24 GB at 300 GB/s, 58 SMs.
    "L4": Device("L4", 121.0, 24.0, 0.3, 32.0, 12.5, 8, 242.5, 58),
    # V100 SXM2 datasheet: 125 TFLOP/s (fp16), 32 GB at 900 GB/s, NVLink 300 GB/s, 80 SMs.
    "V100": Device("V100", 125.0, 32.0, 0.9, 150.0, 12.5, 8, None, 80),
}

# The peaks MFU reads, matched against torch.cuda.get_device_name (in this order).
GPU_PEAK_TFLOPS = {name: gpu.peak_tflops for name, gpu in GPUS.items()}
INTER_NODE_GB_S = GPUS["H100"].network_gb_s
GPUS_PER_NODE = 8

DEVICE_FIELDS = [f.name for f in fields(Device)[1:7]]
"""The fields a device file must give; the rest (OPTIONAL_FIELDS) keep their defaults."""
OPTIONAL_FIELDS = [
    "fp8_peak_tflops",
    "sms",
    "tile_m",
    "tile_n",
    "gemm_fraction",
    "attention_fraction",
]


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
    valid = [*DEVICE_FIELDS, *OPTIONAL_FIELDS]
    unknown = sorted(set(data) - set(valid) - {"name"})
    if unknown:
        raise UserError(
            f"--gpu {path}: unknown field {unknown[0]}; valid: name, {', '.join(valid)}"
        )
    values = {}
    for key in (key for key in valid if key in data):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise UserError(f"--gpu {path}: {key}: {value!r} is not a positive number")
        integer = key in ("gpus_per_node", "sms", "tile_m", "tile_n")
        values[key] = int(value) if integer else float(value)
    for key in ("gemm_fraction", "attention_fraction"):
        if values.get(key, 0) > 1:
            raise UserError(f"--gpu {path}: {key}: {values[key]} is above 1")
    return Device(name=str(data.get("name", path.stem)), **values)
