"""fp8 from the command line: `check` names the recipe and says the GEMMs are emulated; a bad
recipe, blockwise shards that would cut a 128 block (over tp, the key heads' among them, or the
cp chunks of the
weight-gradient tiles, blockwise experts at cp 2) and a GPU without fp8 are one line, exit 2; a
tiny-moe run (attention, routed and shared experts in fp8) says once that it emulates, and its
checkpoint (fp32 master weights) resumes in bf16; an fp8 checkpoint resumes exactly in fp8 and
loads in fp32 and bf16, and a bf16 one in fp8."""

from __future__ import annotations

import math

import pytest
import torch

from megatronish.errors import UserError
from megatronish.fp8 import check_device
from tests.conftest import CONFIGS, SMALLEST_RUN, invoke_cli, read_metrics
from tests.tolerances import FP8_CONTINUED_REL

FP8 = ["train.precision=fp8"]
TINY = [
    *SMALLEST_RUN,
    "train.warmup_steps=10",
    "train.log_every=1",
    "train.eval_every=0",
]


def config_args(*sets: str, config: str = "tiny.yaml") -> list[str]:
    return ["--config", str(CONFIGS / config), *(a for s in sets for a in ("--set", s))]


def test_check_prints_the_fp8_recipe_and_that_it_is_emulated():
    result = invoke_cli("check", *config_args(*FP8, "train.fp8_recipe=blockwise"))
    assert result.returncode == 0, result.stderr
    assert "fp8: blockwise (1 x 128 tiles of activations and gradients" in result.stdout
    assert "fp8 amax all-reduces per step and rank (tp 1, cp 1, stage 0): 0 calls" in result.stdout
    assert "train.precision: fp8 is emulated on cpu" in result.stdout


@pytest.mark.parametrize(
    ("sets", "key", "detail"),
    [
        (["train.fp8_recipe=rowise"], "train.fp8_recipe", "tensorwise | rowwise | blockwise"),
        (
            ["train.fp8_recipe=blockwise", "parallel.tp=2"],
            "train.fp8_recipe",
            "(model.n_head + 2 model.n_kv_head) x head dim = 384 over parallel.tp=2 into 192",
        ),
        (  # q, k and v tiled each from its own first row: k's 64 rows a rank would cut one
            ["train.fp8_recipe=blockwise", "parallel.tp=2", "model.arch=llama"]
            + ["model.d_model=512", "model.n_head=8", "model.n_kv_head=2", "model.d_ff=512"],
            "train.fp8_recipe",
            "model.n_kv_head x head dim = 128 over parallel.tp=2 into 64 per rank",
        ),
        (
            ["train.fp8_recipe=blockwise", "parallel.cp=2"],
            "train.fp8_recipe",
            "train.seq_len=128 into chunks of 32 tokens, not a multiple of 128",
        ),
        (
            ["train.fp8_recipe=blockwise", "parallel.cp=2", "train.seq_len=512"]
            + ["model.max_seq_len=512", "model.arch=llama", "model.moe.num_experts=4"],
            "train.fp8_recipe",
            "blockwise with model.moe.num_experts=4 at parallel.cp=2",
        ),
    ],
    ids=[
        "misspelled recipe",
        "blockwise shards cut a block",
        "blockwise key heads cut a block",
        "blockwise cp chunks cut a tile",
        "blockwise experts at cp 2",
    ],
)
def test_bad_fp8_settings_are_one_line_exit_2(sets, key, detail):
    result = invoke_cli("check", *config_args(*FP8, *sets))
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and detail in lines[0], result.stderr


def test_fp8_on_a_gpu_below_compute_capability_8_9_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"train.precision: .* NVIDIA A100-SXM4-80GB is 8.0"):
        check_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert "runs on the fp8 kernels" in check_device(torch.device("cuda"))
    assert "emulated on cuda" in check_device(torch.device("cuda"), "torch")


def test_fp8_moe_run_says_once_it_emulates_and_its_checkpoint_resumes_in_bf16(
    tmp_path, small_dataset
):
    run = [*TINY, "model.moe.d_ff=48", "model.moe.shared_expert=true"]
    run += [f"data.path={small_dataset}", f"run.out_dir={tmp_path}"]
    fp8 = [*run, *FP8, "train.fp8_recipe=rowwise", "train.steps=2"]
    first = invoke_cli("train", *config_args(*fp8, config="tiny-moe.yaml"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("fp8 is emulated on cpu") == 1, first.stderr
    bf16 = [*run, "train.precision=bf16", "train.steps=3"]
    resumed = invoke_cli("train", *config_args(*bf16, config="tiny-moe.yaml"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_000002" in resumed.stdout
    assert "fp8" not in resumed.stderr
    train_lines, _ = read_metrics(tmp_path)
    assert [line["step"] for line in train_lines] == [1, 2, 3]
    assert all(math.isfinite(line["loss"]) for line in train_lines)
    assert all(line["moe_aux_loss"] > 0 for line in train_lines)


def test_fp8_with_the_tp_comm_overlap_is_a_valid_config_for_every_recipe():
    """fp8 and parallel.tp_comm_overlap go together (megatronish.layers.overlap); the
    overlap's own limit (the sequence cut into tp chunks) stays one line."""
    from megatronish.config import derive, load_config

    for recipe in ("tensorwise", "rowwise", "blockwise"):
        sets = ["parallel.tp=2", "parallel.tp_comm_overlap=true", "train.precision=fp8"]
        sets += [f"train.fp8_recipe={recipe}", "model.d_model=256", "model.n_head=2"]
        sets += ["model.d_ff=512", "parallel.sequence_parallel=true"]
        derived = derive(load_config(CONFIGS / "tiny.yaml", sets), 2, vocab_size=256)
        assert derived.tp == 2
    sets = ["parallel.tp=2", "parallel.tp_comm_overlap=true", "train.precision=fp8"]
    cfg = load_config(CONFIGS / "tiny.yaml", [*sets, "train.seq_len=127"])
    with pytest.raises(UserError, match="parallel.tp_comm_overlap"):
        derive(cfg, 2, vocab_size=256)


def test_an_fp8_checkpoint_resumes_exactly_in_fp8_and_loads_in_fp32_and_a_bf16_one_in_fp8(
    tmp_path, small_dataset
):
    data = f"data.path={small_dataset}"
    recipe = [*FP8, "train.fp8_recipe=tensorwise"]

    def train(out: str, *sets: str):
        result = invoke_cli(
            "train", *config_args(*TINY, data, f"run.out_dir={tmp_path / out}", *sets)
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result, [line["loss"] for line in read_metrics(tmp_path / out)[0]]

    _, whole = train("whole", *recipe, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=0")
    saved = tmp_path / "whole" / "checkpoints" / "step_000002"
    resume = f"checkpoint.resume={saved}"
    _, again = train("again", *recipe, "train.steps=4", resume)
    assert again == whole[2:], "fp32 master weights and AdamW state: the same steps 3 and 4"
    for precision in ("fp32", "bf16"):
        result, losses = train(precision, f"train.precision={precision}", "train.steps=3", resume)
        assert "resumed from" in result.stdout and "step_000002" in result.stdout
        assert "fp8" not in result.stderr and len(losses) == 1
        # the step-2 weights in another precision: within 5e-3 of the fp8 run's step 3 (fp8's
        # and bf16's roundings move this loss by about 1e-4), where a fresh model's loss is 3%
        # higher and step 2's 1.3%
        assert abs(losses[0] - whole[2]) <= FP8_CONTINUED_REL * whole[2]
    train("bf16 run", "train.precision=bf16", "train.steps=2")
    bf16_saved = tmp_path / "bf16 run" / "checkpoints" / "step_000002"
    result, losses = train(
        "fp8 from bf16", *recipe, "train.steps=3", f"checkpoint.resume={bf16_saved}"
    )
    assert "resumed from" in result.stdout and len(losses) == 1 and math.isfinite(losses[0])
