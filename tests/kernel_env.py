"""megatronish_kernels' functions imported the way the kernel tests need it.

Triton reads TRITON_INTERPRET when a kernel is defined, so on a machine without CUDA the
variable is set while the kernels are imported (they then run under Triton's interpreter) and
put back afterwards, so other test modules and CLI subprocesses keep their own environment.
The `interpreter_env` fixture of tests/conftest.py (which the kernel test modules use on every
test) sets INTERPRET again inside each test, for ops.resolve_backend, which reads it at call
time.
"""

from __future__ import annotations

import os

import torch


def _import_kernels():
    before = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatronish_kernels import functions

    interpret = os.environ.get("TRITON_INTERPRET")
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before
    return functions, interpret


kernels, INTERPRET = _import_kernels()
