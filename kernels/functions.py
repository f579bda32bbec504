"""The Triton kernels' public functions, which megatronish.ops calls.

The kernels/ folder installs as ``megatronish_kernels`` and has no ``__init__.py`` on purpose:
PyPI's unrelated ``kernels`` package (which transformers imports) is a regular package, and
Python prefers a regular package over a folder without ``__init__.py`` wherever it stands on
the path, so the repo's kernels/ never shadows it, even from the repo root. Import the
modules by name (``from megatronish_kernels import functions``).

Every function but the fp8 ones is autograd-capable (a torch.autograd.Function with a Triton
forward and backward; megatronish.fp8 calls fp8_amax, fp8_cast and fp8_gemm inside its own),
takes CUDA tensors (fp32 or bf16; math in fp32, results in the input dtype), or CPU fp32
tensors when TRITON_INTERPRET=1 is set before these modules are imported. Block sizes are
fixed functions of the shapes and the GPU's arch (no autotuning), so every rank compiles the
same kernels; compile_check compiles them for sm_80 and sm_90 (the fp8 ones for sm_89 and
sm_90) without a GPU.

Pure compute: nothing here imports megatronish (which imports these kernels through its ops).
Tensor-parallel communication comes in from the caller: cross_entropy takes a VocabSplit whose
combine does the collectives (megatronish.ops builds it on megatronish.distributed.comm).
"""

from .attention_autograd import attention
from .attention_ring import attention_block_backward, attention_block_forward
from .cross_entropy import VocabSplit, cross_entropy
from .elementwise import bias_gelu, geglu, swiglu
from .fp8_cast import fp8_amax, fp8_cast
from .fp8_gemm import fp8_gemm
from .gated_delta import gated_delta_rule
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
    "fp8_amax",
    "fp8_cast",
    "fp8_gemm",
    "gated_delta_rule",
    "geglu",
    "grouped_mm",
    "layer_norm",
    "rms_norm",
    "rope",
    "swiglu",
]
