"""Triton kernels behind megatronish.ops (installed as ``megatronish_kernels``).

Every function is autograd-capable (a torch.autograd.Function with a Triton forward and
backward), takes CUDA tensors (fp32 or bf16; math in fp32, results in the input dtype), or CPU
fp32 tensors when TRITON_INTERPRET=1 is set before this package is imported. Block sizes are
fixed functions of the shapes and the GPU's arch (no autotuning), so every rank compiles the
same kernels; compile_check compiles them for sm_80 and sm_90 without a GPU.

Pure compute: nothing here imports megatronish (which imports these kernels through its ops).
Tensor-parallel communication comes in from the caller: cross_entropy takes a VocabSplit whose
combine does the collectives (megatronish.ops builds it on megatronish.distributed.comm).
"""

from .attention import attention, attention_block_backward, attention_block_forward
from .cross_entropy import VocabSplit, cross_entropy
from .elementwise import bias_gelu, swiglu
from .grouped_gemm import grouped_mm
from .norms import layer_norm, rms_norm
from .rope import rope

__all__ = [
    "VocabSplit",
    "attention",
    "attention_block_backward",
    "attention_block_forward",
    "bias_gelu",
    "cross_entropy",
    "grouped_mm",
    "layer_norm",
    "rms_norm",
    "rope",
    "swiglu",
]
