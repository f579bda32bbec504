"""FP8 training of the linear layers (train.precision: fp8): the recipes (tensorwise, rowwise,
blockwise), the casts with torchao's scale arithmetic, and the three GEMMs of a linear layer
with fp8 operands, exact across tensor parallelism, and those of a layer of experts
(grouped). On CPU the GEMMs are emulated (quantize,
dequantize, fp32 matmul)."""

from megatronish.fp8.device import check_device
from megatronish.fp8.gemm import (
    Scales,
    forward_gemm,
    fp8_linear,
    grad_input_gemm,
    grad_weight_gemm,
    weights_changed,
    weights_fixed,
)
from megatronish.fp8.grouped import fp8_experts
from megatronish.fp8.parts import Parts
from megatronish.fp8.quantize import Split, TokenGroups
from megatronish.fp8.recipes import RECIPES, Operand, Recipe

__all__ = [
    "RECIPES",
    "Operand",
    "Parts",
    "Recipe",
    "Scales",
    "Split",
    "TokenGroups",
    "check_device",
    "forward_gemm",
    "fp8_experts",
    "fp8_linear",
    "grad_input_gemm",
    "grad_weight_gemm",
    "weights_changed",
    "weights_fixed",
]
