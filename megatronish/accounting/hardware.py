"""GPU data sheets (``Device``: dense bf16 and fp8 peaks, memory and its bandwidth, NVLink and
network bandwidth per GPU, GPUs per node, and what shapes a GEMM's efficiency: streaming
multiprocessors, cuBLAS's output tile, the fraction of the peak a large GEMM reaches), a YAML
file describing another device (``load_device``; scripts/gpu_check.py writes one from
measurements), and the lookup by name that `plan --gpu NAME` and MFU use (``device_named``).
The network a GPU sits in is accounting.cluster's.

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
    fp8_tflops: float = 0.0
    """Dense fp8 (e4m3) matmul peak, TFLOP/s; 0: the GPU has no fp8 tensor cores."""
    sms: int = 108
    """Streaming multiprocessors: a GEMM's output tiles run in waves of this many."""
    tile: int = 128
    """Rows of the output tile cuBLAS uses for large 16-bit GEMMs."""
    tile_n: int = 128
    """Its columns: 128 on Ampere and Ada, 256 from Hopper on (the warp-group MMA's 128 x 256
    CUTLASS default)."""
    gemm_fraction: float = 0.80
    """Of the dense peak, what a large GEMM whose tiles fill whole waves reaches."""
    attention_forward: float = 0.50
    """Of the dense peak, what megatronish's fused attention reaches forward."""
    attention_backward: float = 0.50
    """... and backward."""

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def tile_shape(self) -> tuple[int, int]:
        """(rows, columns) of a GEMM's output tile."""
        return (self.tile, self.tile_n)


# Sources (datasheets, dense, no sparsity; NVLink is the total / 2 for one direction; fp8 the
# dense e4m3 figure, half the datasheet's "with sparsity" one; SMs from the architecture
# whitepapers). gemm_fraction, the large-GEMM share of the peak, is the "maximum achievable
# matmul FLOPS" Bekman measured over thousands of shapes with cuBLAS ("Machine Learning
# Engineering", accelerator chapter: A100 SXM 271 of 312, H100 SXM 794 of 989), rounded down
# to what a training step's GEMMs sustain beside its other kernels: 0.80 on Ampere, 0.70 on
# Hopper, whose 700 W budget lowers the clock under sustained tensor-core load (NVIDIA H100
# datasheet: boost clock 1,980 MHz against the 1,830 the dense peak is quoted at, ~1,600-1,750
# measured under GEMM load), 0.70 on Blackwell (1,000 W for 2.25 PFLOP/s).
# Attention: FlashAttention-2 on Ampere reaches 50-70% of the peak forward and 35-50%
# backward (Dao 2023, figures 5-6): 0.50 both ways; from Hopper on megatronish's Triton kernel
# (the Triton tutorial's design) reaches 40-50% of the peak forward and about 20% backward.
NEWER = {"tile_n": 256, "attention_forward": 0.45, "attention_backward": 0.20}
HOPPER = {"sms": 132, "gemm_fraction": 0.70, **NEWER}
GPUS = {
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOP/s bf16, 1,979 fp8, 141 GB,
    # 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8 x 400 Gb/s ConnectX-7 (one a GPU).
    "H200": Device("H200", 989.0, 141.0, 4.8, 450.0, 50.0, 8, 1979.0, **HOPPER),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16, 1,979 fp8, 80 GB,
    # 3.35 TB/s, NVLink 900 GB/s; DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 (one a GPU).
    "H100": Device("H100", 989.0, 80.0, 3.35, 450.0, 50.0, 8, 1979.0, **HOPPER),
    # H800 (China export variant of H100 SXM): NVLink cut to 400 GB/s.
    "H800": Device("H800", 989.0, 80.0, 3.35, 200.0, 50.0, 8, 1979.0, **HOPPER),
    # NVIDIA GH200 Grace Hopper datasheet: 989 TFLOP/s bf16, 1,979 fp8, 96 GB HBM3 at 4 TB/s.
    "GH200": Device("GH200", 989.0, 96.0, 4.0, 450.0, 50.0, 4, 1979.0, **HOPPER),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training for 8 GPUs -> 4.5 PFLOP/s dense fp8,
    # 2.25 dense bf16 a GPU, 1,440 GB HBM3e (180 a GPU) at 64 TB/s (8 a GPU), NVLink 5
    # 1.8 TB/s, 8 x 400 Gb/s; 148 SMs (Blackwell whitepaper).
    "B200": Device(
        "B200", 2250.0, 180.0, 8.0, 900.0, 50.0, 8, 4500.0, 148, gemm_fraction=0.70, **NEWER
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s, no fp8, 2,039 GB/s,
    # NVLink 600 GB/s, 108 SMs; DGX A100 (Selene): 8 x 200 Gb/s HDR InfiniBand (one a GPU).
    "A100": Device("A100", 312.0, 80.0, 2.039, 300.0, 25.0, 8),
    "A800": Device("A800", 312.0, 80.0, 2.039, 200.0, 25.0, 8),
    # PCIe cards (no NVLink: PCIe 4.0 x16, 32 GB/s; a 100 Gb/s network per GPU assumed).
    # L40S datasheet: 362 TFLOP/s bf16, 733 fp8, 48 GB at 864 GB/s, 142 SMs (Ada).
    "L40S": Device("L40S", 362.0, 48.0, 0.864, 32.0, 12.5, 8, 733.0, 142, gemm_fraction=0.70),
    # A10G (AWS g5): 24 GB at 600 GB/s, 80 SMs.
    "A10G": Device("A10G", 125.0, 24.0, 0.6, 32.0, 12.5, 8, 0.0, 80),
    # L4 datasheet: 121 TFLOP/s bf16, 242 fp8, 24 GB at 300 GB/s, 58 SMs (Ada).
    "L4": Device("L4", 121.0, 24.0, 0.3, 32.0, 12.5, 8, 242.0, 58, gemm_fraction=0.70),
    # V100 SXM2 datasheet: 125 TFLOP/s (fp16), no fp8, 32 GB at 900 GB/s, NVLink 300 GB/s,
    # 80 SMs.
    "V100": Device("V100", 125.0, 32.0, 0.9, 150.0, 12.5, 8, 0.0, 80),
}

# The peaks MFU reads, matched against torch.cuda.get_device_name (in this order).
GPU_PEAK_TFLOPS = {name: gpu.peak_tflops for name, gpu in GPUS.items()}
INTER_NODE_GB_S = GPUS["H100"].network_gb_s
GPUS_PER_NODE = 8

OPTIONAL_FIELDS = [
    "fp8_tflops",
    "sms",
    "tile",
    "tile_n",
    "gemm_fraction",
    "attention_forward",
    "attention_backward",
]
DEVICE_FIELDS = [f.name for f in fields(Device) if f.name not in ("name", *OPTIONAL_FIELDS)]
DEVICE_COUNTS = ("gpus_per_node", "sms", "tile", "tile_n")


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
    """A Device from a YAML mapping with every required field of ``Device`` (name and
    OPTIONAL_FIELDS optional: the file's stem, no fp8, and Ampere's SMs, tile and GEMM
    fraction). A missing file, a missing or unknown field, a count (DEVICE_COUNTS) that is not a
    whole number >= 1, or another value that is not a positive number (fp8_tflops may be 0; the
    shares of the peak at most 1) is a UserError that names it."""
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
    valid = DEVICE_FIELDS + OPTIONAL_FIELDS
    unknown = sorted(set(data) - set(valid) - {"name"})
    if unknown:
        raise UserError(
            f"--gpu {path}: unknown field {unknown[0]}; valid: name, {', '.join(valid)}"
        )
    values = {}
    for key in (k for k in valid if k in data):
        value, least = data[key], 0 if key == "fp8_tflops" else 1e-12
        number = not isinstance(value, bool) and isinstance(value, int | float)
        if key in DEVICE_COUNTS:
            if not number or value != int(value) or value < 1:
                raise UserError(f"--gpu {path}: {key}: {value!r} is not an integer >= 1")
            values[key] = int(value)
            continue
        if not number or value < least:
            what = "a number >= 0" if key == "fp8_tflops" else "a positive number"
            raise UserError(f"--gpu {path}: {key}: {value!r} is not {what}")
        if key in ("gemm_fraction", "attention_forward", "attention_backward") and value > 1:
            raise UserError(f"--gpu {path}: {key}: {value!r} is above 1 (a share of the peak)")
        values[key] = float(value)
    return Device(name=str(data.get("name", path.stem)), **values)
