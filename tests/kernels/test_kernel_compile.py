"""Every Triton kernel compiled for sm_80 and sm_90 without a GPU (megatronish_kernels
.compile_check): one cubin per kernel and arch at one representative bf16 configuration each,
the attention kernels also under document masks, and under document masks and a sliding
window, and that again at DeepSeek-V3's head dims (`scripts/kernel_report.py --representative`),
with no register spills and shared memory within the arch's limit per block; a deliberately
oversized tile is caught with a clear message. The full matrix of the shipped configs is the
report script's, not a test's.

The kernels of this process are defined under Triton's interpreter, which compiles nothing:
the compilation runs in one subprocess with TRITON_INTERPRET=0, started with the session
(conftest's side_checks) so that it runs beside the other tests, with a Triton cache of its
own (always cold). Where Triton cannot compile for NVIDIA targets the tests skip, saying why.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests import kernel_env  # noqa: F401 (defines the kernels as the other kernel tests do)
from tests.conftest import REPO, finish, start

COMPILE_TEST = "test_every_kernel_compiles_for_sm80_and_sm90_with_no_spills_at_bf16"
ARCHS = ("sm_80", "sm_90")


def _compile_check():
    return importlib.import_module("megatronish_kernels.compile_check")


def _kernel_report():
    spec = importlib.util.spec_from_file_location(
        "kernel_report", REPO / "scripts" / "kernel_report.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def oversized_tile(arch_name: str):
    """The grouped GEMM's bf16 launch of tiny-moe with a 64 x 64 x 256 tile in 5 stages: about
    320 KB of shared memory per block, over both archs' limits, and no spills."""
    check, report = _compile_check(), _kernel_report()
    shapes = report.model_shapes("tiny-moe", 1)
    launches = check.model_launches(shapes, "bf16", check.ARCHS[arch_name])
    launch = next(launch for launch, _ in launches if launch.name == "_grouped_mm_kernel")
    tiles = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256)
    return dataclasses.replace(
        launch, constexprs={**launch.constexprs, **tiles}, num_warps=8, num_stages=5
    )


def compile_for_tests(out_dir: str) -> None:
    """In the subprocess: kernel_report's representative rows for sm_80 and sm_90 (its JSON,
    its table and exit status) and the oversized tile compiled for sm_90, into out_dir; or
    only why Triton cannot compile here."""
    out = Path(out_dir)
    check = _compile_check()
    reason = check.compile_support()
    if reason is not None:
        (out / "result.json").write_text(json.dumps({"unsupported": reason}))
        return
    args = ["--arch", *ARCHS, "--representative", "--json", str(out / "rows.json"), "--jobs", "1"]
    with open(out / "table.txt", "w") as table, redirect_stdout(table):
        status = _kernel_report().main(args)
    broken = check.compile_and_measure(oversized_tile("sm_90"), check.ARCHS["sm_90"])
    result = {"status": status, "broken": dataclasses.asdict(broken)}
    (out / "result.json").write_text(json.dumps(result))


def _compile_command(tmp_path_factory):
    if importlib.util.find_spec("triton") is None:
        return None
    out = tmp_path_factory.mktemp("kernel-compile")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(out / "cache")}
    code = "import sys; from tests.kernels.test_kernel_compile import compile_for_tests; "
    code += "compile_for_tests(sys.argv[1])"
    return [sys.executable, "-c", code, str(out)], env


# Started with the session (conftest's side_checks) when its test is selected.
SIDE_CHECKS = {COMPILE_TEST: _compile_command}


@pytest.fixture(scope="module")
def compiled(side_checks, tmp_path_factory) -> dict:
    """The subprocess's results: rows (Compiled per kernel and arch), table, status, broken."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    started = side_checks.pop(COMPILE_TEST, None)
    if started is None:  # its side check was not started: this module's other tests only
        started = start(*_compile_command(tmp_path_factory))
    result = finish(started, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(started.proc.args[-1])
    found = json.loads((out / "result.json").read_text())
    if "unsupported" in found:
        pytest.skip(f"Triton cannot compile for NVIDIA targets here: {found['unsupported']}")
    check = _compile_check()
    rows = [check.Compiled(**row) for row in json.loads((out / "rows.json").read_text())]
    broken = check.Compiled(**found["broken"])
    return {"rows": rows, "table": (out / "table.txt").read_text(), **found, "broken": broken}


def assert_fits(rows) -> None:
    """The test helper: fails, naming each kernel, configuration and arch with what is wrong,
    unless every row has a cubin, no register spills and shared memory within its limit."""
    check = _compile_check()
    found = [f"{r.kernel} [{r.config}] on {r.arch}: no cubin" for r in rows if not r.cubin_bytes]
    for row in rows:
        found += check.problems(row)
    assert not found, "kernels that do not fit the GPU:\n" + "\n".join(found)


def every_kernel() -> set[str]:
    """The names of the jit functions the kernel modules launch (named *_kernel)."""
    names = set()
    for module in ("attention", "attention_bwd", "norms", "rope", "elementwise", "cross_entropy"):
        module = importlib.import_module(f"megatronish_kernels.{module}")
        names |= {name for name in vars(module) if name.endswith("_kernel")}
    return names | {"_grouped_mm_kernel", "_grouped_dw_kernel"}


FP8_KERNELS = {"_amax_kernel", "_tile_cast_kernel", "_row_cast_kernel", "_fp8_gemm_kernel"}
"""The fp8 casts and GEMM: compiled for sm_90, not for sm_80 (no fp8 tensor cores)."""


def test_every_kernel_compiles_for_sm80_and_sm90_with_no_spills_at_bf16(compiled):
    rows = compiled["rows"]
    fp8 = {"sm_80": set(), "sm_90": FP8_KERNELS}
    for arch in ARCHS:
        assert {r.kernel for r in rows if r.arch == arch} == every_kernel() | fp8[arch], arch
    assert all(r.dtype == "bf16" for r in rows if r.kernel != "_fp8_gemm_kernel")
    assert {r.dtype for r in rows if r.kernel == "_fp8_gemm_kernel"} == {"fp8e4nv"}
    # DeepSeek-V3's latent attention (kernel_report.MLA_V3): each attention kernel at query-key
    # head dim 192 (128 + 64) with values of 128, under document masks and a sliding window.
    v3 = {(r.kernel, r.arch) for r in rows if "HEAD_DIM=128 QK_REST=64 V_DIM=128" in r.config}
    attention = ("_attn_fwd_kernel", "_dkdv_kernel", "_dq_kernel")
    assert v3 == {(kernel, arch) for kernel in attention for arch in ARCHS}
    assert_fits(rows)
    assert compiled["status"] == 0, compiled["table"]
    header = compiled["table"].splitlines()[0].split()
    assert header[:4] == ["kernel", "configuration", "arch", "dtype"]
    limits = {r.arch: r.shared_limit_bytes for r in rows}
    assert limits == {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
    assert all(0 < r.occupancy_warps <= 64 for r in rows)


def test_a_tile_too_large_for_shared_memory_fails_the_check_with_a_clear_message(compiled):
    broken = compiled["broken"]
    assert broken.cubin_bytes > 0 and broken.spill_bytes == 0
    with pytest.raises(AssertionError) as failure:
        assert_fits([broken])
    message = str(failure.value)
    assert "_grouped_mm_kernel [BLOCK_M=64 BLOCK_N=64 BLOCK_K=256" in message
    assert f"needs {broken.shared_bytes} bytes of shared memory per block" in message
    assert "over the sm_90 limit of 232448: use smaller tiles or fewer stages" in message


def test_the_signature_specializes_the_arguments_as_tritons_launcher_does():
    import torch

    check = _compile_check()
    attention_bwd = importlib.import_module("megatronish_kernels.attention_bwd")
    q = torch.empty(2, 4, 100, 32, dtype=torch.bfloat16, device="meta")
    lse = torch.empty(2, 4, 100, device="meta")
    consts = dict(CAUSAL=True, DOCS=False, WINDOW=False, HEAD_DIM=32, QK_REST=0, V_DIM=32)
    consts |= dict(SOFTCAP=False, BLOCK_M=64, BLOCK_N=32, PREC="tf32")
    args = (q, q, q, q, lse, lse, q, None, None, None, 100, 4, 1, 0.25, 0.5, None, None, None)
    signature, constexprs, attrs = check.specialization(
        check.Launch(attention_bwd._dq_kernel, (1,), args, consts)
    )
    names = attention_bwd._dq_kernel.arg_names
    assert [signature[n] for n in names[:7]] == ["*bf16"] * 4 + ["*fp32"] * 2 + ["*bf16"]
    scalars = [signature[n] for n in ("seq_len", "n_head", "qk_scale", "sm_scale")]
    assert scalars == ["i32", "i32", "fp32", "fp32"]
    assert signature["group"] == "constexpr" and constexprs["group"] == 1  # 1 is specialized
    assert signature["HEAD_DIM"] == "constexpr" and constexprs["HEAD_DIM"] == 32
    # No document masks, no window, no soft-cap: the segment pointers, the window and the
    # soft-cap's scale are absent, None.
    for name in ("QSEG", "window", "offset", "cap_in"):
        assert signature[name] == "constexpr" and constexprs[name] is None
    # Pointers are 16-byte aligned; 100 and 4 are not multiples of 16.
    assert {names[i] for (i,) in attrs} == {"Q", "K", "V", "DO", "LSE", "DELTA", "DQ"}

    consts = dict(V_DIM=32, BLOCK=64)
    delta = check.Launch(attention_bwd._delta_kernel, (1,), (q, q, lse, 2**31), consts)
    signature, _, attrs = check.specialization(delta)
    assert signature["n_rows"] == "i64" and (3,) in attrs  # past 2^31, a multiple of 16
    with pytest.raises(ValueError, match="_delta_kernel: 3 arguments"):
        check.specialization(dataclasses.replace(delta, args=(q, q, lse)))


def test_a_machine_triton_cannot_compile_on_gives_the_reason_to_skip_with(monkeypatch):
    check = _compile_check()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if "nvidia" in name else find_spec(name)
    )
    assert check.compile_support() == "Triton has no NVIDIA backend on this platform"
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    if find_spec("triton.backends.nvidia") is not None:
        monkeypatch.setattr(check.shutil, "which", lambda path: None)
        assert check.compile_support() == "Triton's ptxas is missing"
