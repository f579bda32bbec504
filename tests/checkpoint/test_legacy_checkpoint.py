"""A checkpoint written by an earlier version of the package (tests/fixtures/legacy, step 3 of a
6-step llama run; expected.json holds what that version computed from it) still loads, evaluates,
resumes on the same losses, generates the same text and exports to Hugging Face."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import REPO, invoke_cli, read_metrics
from tests.tolerances import FP32_LOGITS_ABS, FP32_REORDER

pytestmark = pytest.mark.slow  # the old checkpoint evaluated, resumed and exported

LEGACY = REPO / "tests" / "fixtures" / "legacy"
CHECKPOINT = LEGACY / "checkpoint" / "step_000003"
EXPECTED = json.loads((LEGACY / "expected.json").read_text())


def _logits() -> torch.Tensor:
    from megatronish import load_model

    model = load_model(CHECKPOINT)
    with torch.no_grad():
        return model(torch.tensor([EXPECTED["logits_tokens"]]))[0].double()


def test_load_model_of_the_old_checkpoint_gives_the_old_logits():
    # The logits are fp32: equal to fp32 rounding (the BLAS kernels, and so the last bits,
    # differ between processors).
    fp32 = {"rtol": FP32_REORDER, "atol": FP32_LOGITS_ABS}
    logits = _logits()
    assert logits.argmax(-1).tolist() == EXPECTED["logits_argmax"]
    torch.testing.assert_close(
        logits.logsumexp(-1),
        torch.tensor(EXPECTED["logits_logsumexp"], dtype=torch.float64),
        **fp32,
    )
    torch.testing.assert_close(
        logits.sum(-1), torch.tensor(EXPECTED["logits_sum"], dtype=torch.float64), **fp32
    )


def test_eval_and_greedy_generate_of_the_old_checkpoint_give_the_old_results():
    result = invoke_cli(
        "eval", "--checkpoint", str(CHECKPOINT), "--set", f"data.path={LEGACY / 'data'}"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["val_loss"] == pytest.approx(
        EXPECTED["eval_val_loss_step_3"], rel=FP32_REORDER
    )
    result = invoke_cli(
        "generate", "--checkpoint", str(CHECKPOINT), "--prompt", EXPECTED["generate_prompt"],
        "--max-new-tokens", "16", "--temperature", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == EXPECTED["generate_greedy_16"]


def test_the_old_checkpoint_resumes_on_the_old_losses(tmp_path):
    result = invoke_cli(
        "train", "--config", str(LEGACY / "legacy.yaml"),
        "--set", f"data.path={LEGACY / 'data'}",
        "--set", f"checkpoint.resume={CHECKPOINT}",
        "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "--set", f"run.out_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    train, val = read_metrics(tmp_path / "run")
    assert {str(x["step"]): x["loss"] for x in train} == pytest.approx(
        EXPECTED["losses"], rel=FP32_REORDER
    )
    assert [x["val_loss"] for x in val if x["step"] == 6] == pytest.approx(
        [EXPECTED["val_loss_step_6"]], rel=FP32_REORDER
    )


def test_the_old_checkpoint_exports_to_transformers_with_the_old_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    result = invoke_cli(
        "export", "--checkpoint", str(CHECKPOINT), "--format", "hf", "--output", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = hf_model(torch.tensor([EXPECTED["logits_tokens"]])).logits[0].double()
    torch.testing.assert_close(theirs, _logits(), atol=FP32_REORDER, rtol=FP32_REORDER)
