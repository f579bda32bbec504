"""scripts/gpu_check.py without a GPU: the one-line refusal (exit 2), the markdown table of a
recorded run (tests/fixtures/gpu_check_sample.json), --from-json, pytest's closing line and the
time budget."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import kernel_env  # noqa: F401 (the kernels as the kernel tests define them)
from tests.conftest import REPO, finish, invoke_cli
from tests.tolerances import PRINTED_TENTHS_ABS

SCRIPT = REPO / "scripts" / "gpu_check.py"
SAMPLE = REPO / "tests" / "fixtures" / "gpu_check_sample.json"
NO_GPU_TEST = "test_without_a_gpu_it_exits_2_with_one_line_on_stderr"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script()


def _no_gpu_command(tmp_path_factory):
    # No GPU visible even on a machine that has one; --json into a temporary directory, where
    # a run that went on would write.
    out = tmp_path_factory.mktemp("gpu-check") / "out.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return [sys.executable, str(SCRIPT), "--json", str(out)], env


# Started with the session (conftest's side_checks): the subprocess imports torch, the slow part.
SIDE_CHECKS = {NO_GPU_TEST: _no_gpu_command}


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def cells(line: str) -> list[str]:
    """The cells of a markdown table line (an escaped \\| stays inside its cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_render_of_a_recorded_run_is_one_table_with_a_row_per_figure():
    results = json.loads(SAMPLE.read_text())
    text = gpu_check.render(results)
    first = text.splitlines()[0]
    assert first.startswith("gpu_check on 2 x NVIDIA A100-SXM4-40GB: torch 2.13.0+cu130")
    lines = table_lines(text)
    assert lines[0] == "| section | name | what | ours | torch / reference | unit | status |"
    assert cells(lines[1]) == ["---", "---", "---", "---:", "---:", "---", "---"]
    body = [cells(line) for line in lines[2:]]
    assert len(body) == len(results["rows"])
    assert {len(row) for row in body} == {7}
    assert {row[0] for row in body} == {"tests", "device", "kernels", "training"}
    by_what = {(row[1], row[2]): row for row in body}
    tests = by_what["pytest -m cuda", "passed / failed / skipped"]
    assert tests[3:] == ["10 / 0 / 0", "-", "tests", "ok"]
    attention = "attention b4 h32/kv8 s2048 d128"
    assert by_what[attention, "forward time"][3:6] == ["0.800", "0.740", "ms"]
    assert by_what[attention, "forward rate"][3:6] == ["171.8", "185.7", "TFLOP/s"]
    assert by_what["rms_norm 8192x4096", "forward rate"][3:6] == ["1.24", "0.18", "TB/s"]
    errors = by_what["rms_norm 8192x4096", "output max error vs fp64"]
    assert errors[3:6] == ["3.12e-02", "3.12e-02", "abs"]
    assert by_what["gpt2-124m tp1", "throughput"][3:5] == ["164,032", "-"]
    assert by_what["gpt2-124m tp1", "MFU"][3] == "45.0"
    assert by_what["gpt2-124m tp1", "step time"][3] == "0.100"
    assert by_what["gpt2-124m tp1", "peak memory (ref: plan's estimate)"][3:5] == ["11.84", "10.97"]
    statuses = [row[6] for row in body]
    assert statuses.count("ok") == len(body) - 3
    oom = by_what["gpt2-1.3b tp1", "throughput"]
    assert oom[3] == "-" and oom[6].startswith("failed: exit 1: torch.OutOfMemoryError")
    assert (
        by_what["grouped_mm", "-"][6] == "skipped: megatronish_kernels has no grouped GEMM kernel"
    )
    assert by_what["gpt2-1.3b tp2", "-"][6] == "skipped: time budget"


def test_cells_with_a_pipe_or_a_newline_stay_one_cell():
    row = gpu_check.row("training", "a|b", "x", None, 1.5, "GB", "failed: one\ntwo")
    line = table_lines(gpu_check.render({"rows": [row]}))[2]
    assert cells(line) == ["training", "a\\|b", "x", "-", "1.50", "GB", "failed: one two"]


def test_from_json_prints_the_recorded_table_and_exits_0():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", str(SAMPLE)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == gpu_check.render(json.loads(SAMPLE.read_text())) + "\n"


def test_from_json_of_a_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert gpu_check.main(["--from-json", str(tmp_path / "none.json")]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_pytest_closing_line_counts():
    closing = "1 failed, 5 passed, 1 skipped, 2 errors, 9 deselected in 4.10s"
    output = f"....s.F\nFAILED tests/x.py::t\n{closing}\n"
    assert gpu_check.parse_pytest_summary(output) == {
        "failed": 1,
        "passed": 5,
        "skipped": 1,
        "error": 2,
        "deselected": 9,
    }
    assert gpu_check.parse_pytest_summary("10 skipped, 311 deselected in 3.32s") == {
        "skipped": 10,
        "deselected": 311,
    }
    assert gpu_check.parse_pytest_summary("ImportError: no module named x") is None


def test_jobs_after_the_budget_or_their_phase_limit_are_skipped_rows():
    ran = []

    def job(section, name, fail=False):
        def run(timeout):
            ran.append((name, timeout))
            if fail:
                raise RuntimeError("CUDA out of memory\nmore")
            return [gpu_check.row(section, name, "w", 1.0, None, "ms")], {"name": name}

        return gpu_check.Job(section, name, run, limit_s=5.0)

    jobs = [job("kernels", "a"), job("kernels", "b", fail=True), job("training", "c")]
    rows, details = gpu_check.run_jobs(jobs, gpu_check.Clock(budget_s=100, hard_s=120))
    assert [r["status"] for r in rows] == ["ok", "failed: RuntimeError: CUDA out of memory", "ok"]
    assert [t for _, t in ran] == [5.0, 5.0, 5.0]
    assert [d["name"] for d in details["kernels"]] == ["a", "b"]
    rows, _ = gpu_check.run_jobs(jobs, gpu_check.Clock(budget_s=0, hard_s=120))
    assert {r["status"] for r in rows} == {"skipped: time budget"}
    rows, _ = gpu_check.run_jobs(jobs, gpu_check.Clock(), phase_limits={"kernels": 0})
    assert [r["status"] for r in rows] == ["skipped: kernels phase limit (0 s)"] * 2 + ["ok"]


def test_compile_rows_put_the_drivers_figures_next_to_the_cubins_and_fail_a_difference():
    figures = {"registers": 168, "spill_bytes": 0, "shared_bytes": 41984, "occupancy_warps": 8}
    same = {"kernel": "_dq_kernel", "arch": "sm_90", "driver": figures, "cubin": dict(figures)}
    other = {**same, "kernel": "_attn_fwd_kernel", "cubin": {**figures, "registers": 162}}
    other["cubin"]["occupancy_warps"] = 16
    rows = gpu_check.compile_rows([same, other])
    assert [r["section"] for r in rows] == ["compile", "compile"]
    assert rows[0]["name"] == "_dq_kernel sm_90" and rows[0]["status"] == "ok"
    assert rows[0]["what"] == "regs / spill B / shared B / warps per SM (driver vs cubin)"
    assert (rows[0]["ours"], rows[0]["reference"]) == ("168 / 0 / 41984 / 8",) * 2
    assert rows[1]["reference"] == "162 / 0 / 41984 / 16"
    assert rows[1]["status"] == "FAIL: registers, occupancy_warps differ"
    assert gpu_check.failed(rows)
    line = table_lines(gpu_check.render({"rows": rows}))[3]
    assert cells(line)[3:] == ["168 / 0 / 41984 / 8", "162 / 0 / 41984 / 16", "", rows[1]["status"]]


def test_packed_attention_rows_put_packed_next_to_causal_and_fail_an_error_over_the_bound():
    result = {
        "times": {
            "causal": {"fwd_ms": 1.0, "fwd_bwd_ms": 4.0},
            "packed": {"fwd_ms": 0.25, "fwd_bwd_ms": 0.6},
        },
        "flops_walked": 0.106,
        "errors": {"ours": 0.01, "torch": 0.008},
    }
    rows = gpu_check.packed_rows("attention 16 docs x 128 s2048", result)
    body = [cells(line) for line in table_lines(gpu_check.render({"rows": rows}))[2:]]
    assert [line[2:] for line in body] == [
        ["forward time (ref: causal)", "0.250", "1.000", "ms", "ok"],
        ["forward+backward time (ref: causal)", "0.600", "4.000", "ms", "ok"],
        ["f+b time % of causal (ref: FLOPs walked %)", "15.0", "10.6", "%", "ok"],
        ["output max error vs fp64 (ref: torch SDPA)", "1.00e-02", "8.00e-03", "abs", "ok"],
    ]
    result["errors"]["ours"] = 0.05
    status = gpu_check.packed_rows("x", result)[-1]["status"]
    assert status == "FAIL: above 2 x torch + 0.02" and gpu_check.failed([{"status": status}])


# Last: the other tests run while its subprocess imports torch.
def test_without_a_gpu_it_exits_2_with_one_line_on_stderr(side_checks):
    result = finish(side_checks.pop(NO_GPU_TEST), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [gpu_check.NO_GPU]
    assert result.stdout == ""
    assert not Path(result.args[-1]).exists()


def test_tp_overlap_split_gemm_gives_the_whole_gemm_within_one_rounding_and_fails_beyond():
    calls = []
    rows, detail = gpu_check.split_gemm_job(
        "cpu", lambda fn: calls.append(fn()) or 1.0, (2, 16, 8, 4)
    )(60.0)
    assert [r["section"] for r in rows] == ["tp-overlap"] * 4
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert [len(c) for c in calls[1:]] == list(gpu_check.SPLIT_CHUNKS)  # t chunks each
    assert all(detail[f"chunks_{t}"]["max_difference"] <= detail["bound"] for t in (2, 8))
    over = gpu_check.split_gemm_rows(2, 1.0, 1.0, error=2e-3, bound=1e-3)
    assert over[1]["status"].startswith("FAIL")


def test_calibration_writes_the_device_file_plan_reads_from_a_fake_measurement(tmp_path):
    from megatronish.accounting.hardware import GPUS, load_device
    from megatronish.accounting.roofline import Efficiency, gemm_efficiency

    h100, whole = GPUS["H100"], Efficiency(gemm_fraction=1.0)

    def time_gemm(m, n, k, fp8):  # a GPU at 60% of the roofline, fp8 at 1500 TFLOP/s
        if fp8:
            return 2.0 * m * n * k / 1500e12
        return 2.0 * m * n * k / (0.6 * h100.peak_flops * gemm_efficiency(m, n, h100, whole))

    path = tmp_path / "mine.yaml"
    rows, detail = gpu_check.calibration_job(time_gemm, path)(60.0)
    device = load_device(path)
    assert device.gemm_fraction == pytest.approx(0.6) and detail["gemm_fraction"] == 0.6
    assert device.peak_tflops == h100.peak_tflops and device.sms == h100.sms
    large = gemm_efficiency(8192, 8192, device, Efficiency())  # the model's fp8 8192^3 rate
    assert device.fp8_tflops * large == pytest.approx(1500, abs=PRINTED_TENTHS_ABS)
    assert [r["section"] for r in rows] == ["calibration"] * 3
    config = str(REPO / "configs" / "gpt2-124m.yaml")
    args = ["--gpus", "8", "--gpu", str(path), "--layout", "dp=8", "--json"]
    result = invoke_cli("plan", "--config", config, *args)
    assert result.returncode == 0, result.stderr


def test_fp8_gemm_job_on_the_interpreter_is_within_the_fp8_bound_and_casts_bit_for_bit(
    interpreter_env,
):
    """The fp8 phase's GEMM rows at a tiny shape on the CPU (the kernels interpreted; no
    torch._scaled_mm there): ours blockwise, tensorwise and rowwise against fp32."""
    fp8 = gpu_check.load_script("gpu_fp8")
    measure = lambda fn: fn() is not None and 1.0  # noqa: E731 (runs each GEMM once)
    rows, detail = fp8.fp8_gemm_job("cpu", measure, (40, 200, 136))(60.0)
    names = {r["name"] for r in rows}
    assert names == {f"GEMM 40x136x200 {r} (ours)" for r in fp8.RECIPES}
    assert {r["section"] for r in rows} == {"fp8"} and all(r["status"] == "ok" for r in rows)
    assert detail["bf16"]["error"] < detail["blockwise (ours)"]["error"]  # fp8 is coarser
    bound = dict(tflops=1.0, error=0.5, bound=0.1, cast_equal=False)
    over = fp8.gemm_rows("g", bound, detail["bf16"])
    assert over[1]["status"].startswith("FAIL") and over[2]["status"].startswith("FAIL")


def test_fp8_loss_rows_fail_a_gap_over_two_percent_or_a_missing_step():
    fp8 = gpu_check.load_script("gpu_fp8")
    good = fp8.loss_rows("r", [5.0, 4.0], [5.0, 4.05])
    assert [r["status"] for r in good] == ["ok", "ok"] and good[0]["ours"] == 4.0
    assert fp8.loss_rows("r", [5.0, 4.0], [5.0, 4.2])[1]["status"].startswith("FAIL: over 2%")
    assert fp8.loss_rows("r", [5.0], [5.0, 4.2])[0]["status"].startswith("FAIL: 1 logged")
