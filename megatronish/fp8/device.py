"""Where fp8 runs: a CUDA GPU with fp8 tensor cores (compute capability 8.9 or newer: Ada,
Hopper, Blackwell) or, emulated, the CPU. Anything else is the user's mistake."""

from __future__ import annotations

import torch

from megatronish.errors import UserError

MIN_CAPABILITY = (8, 9)


def check_device(device: torch.device, backend: str = "auto") -> str:
    """The line a run says once: where its fp8 GEMMs run on `device`, the CPU or a GPU with fp8
    support (on a GPU under kernels.backend auto or triton: the fp8 kernels; else emulated,
    operands cast to fp8 and back, fp32 matmuls); UserError on a CUDA GPU below compute
    capability 8.9."""
    note = (
        f"train.precision: fp8 is emulated on {device.type} (operands cast to fp8 and back, fp32 "
        "matmuls): the numerics of fp8 training, not its speed"
    )
    if device.type != "cuda":
        return note
    if backend != "torch":
        note = (
            "train.precision: fp8 runs on the fp8 kernels (fused casts; blockwise GEMMs on the "
            "scaled fp8 GEMM kernel, tensorwise and rowwise on torch._scaled_mm)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UserError(
            f"train.precision: fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
            f"Blackwell); {name} is {capability[0]}.{capability[1]}; use train.precision=bf16"
        )
    return note
