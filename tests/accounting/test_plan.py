"""`plan`: memory formulas per rank, and a recommended layout that fits."""

from __future__ import annotations

import pytest

from megatronish.accounting.flops import matmul_params
from megatronish.accounting.memory import GB, activation_bytes_per_layer, estimate
from megatronish.commands.plan import plan
from megatronish.config import derive, load_config
from megatronish.distributed.layout import ParallelState
from megatronish.model import GPT
from tests.conftest import CONFIGS, invoke_cli
from tests.tolerances import WRITTEN_COUNT_REL


def test_activation_formula_is_korthikanti_with_fused_attention():
    cfg = load_config(None, ["train.seq_len=256", "train.micro_batch_size=2", "model.d_model=128",
                             "model.max_seq_len=256", "train.precision=bf16"])  # fmt: skip
    sbh = 256 * 2 * 128
    assert activation_bytes_per_layer(cfg, 1, False, "none") == sbh * 34
    assert activation_bytes_per_layer(cfg, 4, False, "none") == sbh * (10 + 24 / 4)
    assert activation_bytes_per_layer(cfg, 4, True, "none") == sbh * 34 / 4
    assert activation_bytes_per_layer(cfg, 4, True, "full") == 2 * sbh / 4


def test_memory_per_rank_falls_with_tp_and_zero_shards_adam():
    cfg = load_config(CONFIGS / "gpt2-1.3b.yaml")
    per_tp = [estimate(cfg, 8, tp).total_gb for tp in (1, 2, 4, 8)]
    assert per_tp == sorted(per_tp, reverse=True)
    no_zero = estimate(cfg, 8, 1, zero=0)
    zero = estimate(cfg, 8, 1, zero=1)
    assert zero.optimizer_gb == pytest.approx(no_zero.optimizer_gb / 8)
    params = 1.3136e9
    assert no_zero.grads_gb == pytest.approx(params * 4 / GB, rel=WRITTEN_COUNT_REL)


def test_plan_recommends_a_layout_that_fits_or_says_it_does_not():
    cfg = load_config(CONFIGS / "gpt2-1.3b.yaml")
    report = plan(cfg, gpus=8, gpu="H100", memory_gb=None)
    assert "recommended: --set parallel.tp=1" in report
    small = plan(cfg, gpus=8, gpu="H100", memory_gb=4)
    recommended = small.splitlines()[-1]
    # 4 GiB: only model parallelism (tp x pp = 8, dp 1) with full recompute fits.
    assert recommended.startswith("recommended:") and "parallel.dp=1 " in recommended
    assert "activation_checkpointing=full" in recommended
    assert "does not fit" in plan(cfg, gpus=1, gpu="H100", memory_gb=2)


def test_cli_plan_unknown_gpu_exits_2():
    result = invoke_cli("plan", "--config", str(CONFIGS / "gpt2-124m.yaml"), "--gpu", "TPU9")
    assert result.returncode == 2 and "--gpu TPU9" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


HEAD_DIM_LLAMA = ["model.arch=llama", "model.n_head=8", "model.n_kv_head=4", "model.d_model=32"]


def test_activation_formula_counts_q_k_v_and_projection_input_at_n_head_times_head_dim():
    sets = HEAD_DIM_LLAMA + ["train.seq_len=64", "model.max_seq_len=64", "train.precision=bf16"]
    sets += ["train.micro_batch_size=1", "train.global_batch_size=1"]
    sbh = 64 * 1 * 32
    wide = load_config(None, sets + ["model.head_dim=8"])  # the heads span 2 d_model: 16 sbh
    assert activation_bytes_per_layer(wide, 1, False, "none") == sbh * (26 + 16)
    assert activation_bytes_per_layer(wide, 4, False, "none") == sbh * (10 + 32 / 4)
    assert activation_bytes_per_layer(wide, 4, True, "none") == sbh * 42 / 4


def test_matmul_flops_count_the_model_linear_weights_whatever_the_head_dim():
    for head_dim in (None, 6, 12):
        sets = ["model.vocab_size=61", f"model.head_dim={'null' if head_dim is None else head_dim}"]
        cfg = load_config(None, HEAD_DIM_LLAMA + sets)
        derived = derive(cfg, 1)
        gpt = GPT(cfg, derived, ParallelState.single())
        linear = sum(
            p.numel()
            for name, p in gpt.named_parameters()
            if p.dim() == 2 and name not in ("tok_emb.weight", "lm_head.weight")
        )
        assert matmul_params(cfg, derived) == linear + 32 * 61, head_dim


CLUSTER_FILE = (
    "gpus_per_node: 8\nintra_node_gb_s: 450\nnvswitch: true\nnics_per_node: 8\nnic_gb_s: 50\n"
    "rail_optimized: true\nsharp: false\npod_gpus: 0\noversubscription: 1\n"
)


def test_a_cluster_file_reads_like_its_preset_and_a_bad_value_is_one_line(tmp_path):
    from megatronish.accounting.cluster import CLUSTERS, cluster_named
    from megatronish.accounting.hardware import GPUS
    from megatronish.errors import UserError

    path = tmp_path / "dgx-h100.yaml"
    path.write_text(CLUSTER_FILE)
    assert cluster_named(str(path), GPUS["H100"]) == CLUSTERS["dgx-h100"]
    for bad, words in (
        ("nvswitch: yes please", "nvswitch: 'yes please' must be true or false"),
        ("oversubscription: 0.5", "oversubscription: 0.5 must be a number >= 1"),
        ("nics: 8", "unknown field nics"),
    ):
        key = bad.split(":")[0]
        lines = [ln for ln in CLUSTER_FILE.splitlines() if not ln.startswith(key + ":")]
        path.write_text("\n".join([*lines, bad]) + "\n")
        with pytest.raises(UserError, match=words):
            cluster_named(str(path), GPUS["H100"])
    with pytest.raises(UserError, match="unknown cluster; valid: dgx-a100-selene"):
        cluster_named("dgx-z9", GPUS["H100"])


def test_cli_bad_cluster_file_and_fp8_on_a100_exit_2_with_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER_FILE.replace("sharp: false", "sharp: maybe"))
    base = ["plan", "--config", str(CONFIGS / "gpt2-124m.yaml"), "--gpus", "8"]
    for args, words in (
        (["--cluster", str(path)], "sharp: 'maybe' must be true or false"),
        (["--gpu", "A100", "--set", "train.precision=fp8"], "A100 has no fp8 tensor cores"),
    ):
        result = invoke_cli(*base, *args)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_gpu_other_than_the_one_a_preset_cluster_holds_exits_2_naming_both(tmp_path):
    base = ["plan", "--config", str(CONFIGS / "gpt2-124m.yaml"), "--gpus", "8"]
    result = invoke_cli(*base, "--gpu", "A100", "--cluster", "dgx-h100")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--gpu A100 --cluster dgx-h100: dgx-h100's nodes hold H100 GPUs, not A100" in lines[0]
    assert "valid: --gpu H100, --cluster dgx-a100-selene, or a cluster YAML file" in lines[0]
    # Without --gpu the preset's own GPU; a cluster file takes any GPU.
    own = invoke_cli(*base, "--cluster", "dgx-a100-selene")
    assert own.returncode == 0 and own.stdout.startswith("plan for 8 x A100"), own.stderr
    path = tmp_path / "h100-nodes.yaml"
    path.write_text(CLUSTER_FILE)
    anywhere = invoke_cli(*base, "--gpu", "A100", "--cluster", str(path))
    assert anywhere.returncode == 0 and "in h100-nodes (" in anywhere.stdout, anywhere.stderr


def test_plan_explains_its_pick_and_names_the_change_that_helps_most():
    cfg = load_config(CONFIGS / "gpt2-1.3b.yaml", ["train.precision=bf16"])
    report = plan(cfg, gpus=8, gpu="H100", memory_gb=None, cluster="dgx-h100", show=1)
    assert "in dgx-h100 (8 GPUs a node on NVSwitch" in report
    assert "recommended" in report and "runner-up" in report and "pipeline_bubble" in report
    assert "GEMMs: " in report and "of the dense bf16 peak" in report
    # fp8 GEMMs shorten this compute-bound step; the line gives the --set that does it.
    assert "the change that would help most: fp8 GEMMs: -" in report
    assert "(--set train.precision=fp8)" in report
    # Under fp8 the tp overlap is a candidate too (its decomposed GEMMs run in fp8, the forward
    # ring carries fp8 casts): at tp 8 without sequence parallelism it helps most.
    off = load_config(CONFIGS / "gpt2-1.3b.yaml", ["train.precision=fp8"])
    one = plan(off, gpus=8, gpu="H100", memory_gb=None, layout="tp=8 dp=1")
    line = next(ln for ln in one.splitlines() if ln.startswith("the change that would help most"))
    assert "tp overlap on: -" in line and "(--set parallel.tp_comm_overlap=true)" in line
    # At tp 8 the 1.3B's attention projection reads k = 2048 / 8 = 256: memory-bound in fp8.
    assert "memory-bound: proj forward" in one


@pytest.mark.parametrize(
    ("config", "gpus", "memory_gb", "words", "sequence_parallel"),
    [
        ("gpt2-1.3b.yaml", 8, 4.0, "sequence parallel at tp > 1, ZeRO-1", "true"),
        (
            "deepseek-v3.yaml",
            None,
            None,
            "no sequence parallel (not with experts), ZeRO-1",
            "false",
        ),
    ],
    ids=["dense", "experts"],
)
def test_the_header_of_the_fastest_layouts_says_what_the_pick_does_with_sequence_parallelism(
    config, gpus, memory_gb, words, sequence_parallel
):
    cfg = load_config(CONFIGS / config)
    report = plan(cfg, gpus=gpus, gpu="H100", memory_gb=memory_gb, show=1)
    header = next(line for line in report.splitlines() if line.startswith("fastest layouts"))
    assert header.endswith(f"recompute; {words}):"), header
    picked = report.splitlines()[-1]
    assert " --set parallel.tp=2 " in picked, picked  # a layout sequence parallelism applies to
    assert f"--set parallel.sequence_parallel={sequence_parallel} " in picked, picked
