"""GPU data sheets: dense bf16 peak, memory and link bandwidth per GPU name, and the node
shape that plan assumes."""

from __future__ import annotations

# Dense bf16 peak per GPU (no sparsity), TFLOP/s, matched against torch.cuda.get_device_name.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "V100": 125.0,
}
GPU_MEMORY_GB = {
    "H200": 141.0,
    "H100": 80.0,
    "H800": 80.0,
    "GH200": 96.0,
    "B200": 180.0,
    "A100": 80.0,
    "A800": 80.0,
    "L40S": 48.0,
    "A10G": 24.0,
    "L4": 24.0,
    "V100": 32.0,
}
# One direction of a GPU's NVLink (PCIe for the cards without it), GB/s.
GPU_LINK_GB_S = {
    "H200": 450.0,
    "H100": 450.0,
    "H800": 200.0,
    "GH200": 450.0,
    "B200": 900.0,
    "A100": 300.0,
    "A800": 200.0,
    "L40S": 32.0,
    "A10G": 32.0,
    "L4": 32.0,
    "V100": 150.0,
}
INTER_NODE_GB_S = 50.0  # one 400 Gb/s NIC per GPU
GPUS_PER_NODE = 8
