"""The step-time model (accounting.step_time) and `plan`'s use of it: it reproduces the
published large runs of Narayanan et al. 2021 and Korthikanti et al. 2022 (tests/published_runs.py
holds the rows and their sources), its parts follow the physics it states, and plan's fixed
layout, JSON and bad input behave as the contract says."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from megatronish.accounting.cluster import CLUSTERS, default_cluster
from megatronish.accounting.collectives import Collective, Purpose, collectives_per_step
from megatronish.accounting.comm_time import Mesh, collective_seconds, inside_node
from megatronish.accounting.flops import model_flops_per_step
from megatronish.accounting.hardware import GPUS, device_named
from megatronish.accounting.roofline import GPU_EFFICIENCY, attention_flops, gemm_time
from megatronish.accounting.step_time import PARTS, step_time
from megatronish.config import derive, load_config
from tests.conftest import CONFIGS, invoke_cli
from tests.published_runs import (
    KORTHIKANTI,
    NARAYANAN,
    RUNS,
    STRONG,
    compare,
    predict,
    published_step_s,
)
from tests.tolerances import (
    FP64_REORDER,
    GEMM_OVERHEAD_REL,
    PUBLISHED_ITERATION_REL,
    PUBLISHED_MEDIAN_REL,
    PUBLISHED_STEP_REL,
)

GPT3 = [
    "model.arch=gpt2", "model.n_layer=96", "model.d_model=12288", "model.n_head=96",
    "model.vocab_size=51200", "model.max_seq_len=2048", "train.seq_len=2048",
    "train.micro_batch_size=1", "train.global_batch_size=1536", "train.precision=bf16",
]  # fmt: skip


def errors(sources: tuple[str, ...]) -> dict[str, float]:
    return {
        f"{r.source}: {r.name}": (pred - pub) / pub
        for r in RUNS
        if r.source in sources
        for _, pub, pred in [compare(r)]
    }


def test_every_published_run_within_20_percent_the_a100_ones_15_and_the_median_under_10():
    errs = errors(tuple({r.source for r in RUNS}))
    assert len(errs) == 25
    worst = max(errs, key=lambda k: abs(errs[k]))
    assert abs(errs[worst]) < PUBLISHED_STEP_REL, f"{worst}: {errs[worst]:+.1%}"
    assert statistics.median(abs(e) for e in errs.values()) < PUBLISHED_MEDIAN_REL
    a100 = errors((NARAYANAN, KORTHIKANTI))
    worst = max(a100, key=lambda k: abs(a100[k]))
    assert abs(a100[worst]) < PUBLISHED_ITERATION_REL, f"{worst}: {a100[worst]:+.1%}"


def test_strong_scaling_loses_mfu_from_96_to_4608_gpus_and_both_steps_within_20_percent():
    small, large = (r for r in RUNS if r.source == STRONG)
    assert predict(large).mfu < predict(small).mfu
    for run in (small, large):
        assert predict(run).step_time_s == pytest.approx(
            published_step_s(run), rel=PUBLISHED_STEP_REL
        )


def test_korthikanti_iteration_times_within_15_percent():
    for run in (r for r in RUNS if r.source == KORTHIKANTI):
        assert predict(run).step_time_s == pytest.approx(
            run.iteration_s, rel=PUBLISHED_ITERATION_REL
        ), run.name


def test_the_breakdown_sums_to_the_step_and_the_bubble_is_p_minus_1_over_v_m():
    run = next(r for r in RUNS if r.name == "175B" and r.source == KORTHIKANTI)
    p = predict(run)
    assert set(p.breakdown) == set(PARTS)
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s)
    per_micro = (p.breakdown["compute"] + p.breakdown["exposed_tp"]) / 64  # m = 64
    assert p.breakdown["pipeline_bubble"] == pytest.approx(per_micro * 7 / 3)  # (p-1)/v x
    # Selective recompute reruns the attention core's forward: 4 s^2 a d FLOPs a sequence.
    assert p.hardware_flops - p.model_flops == pytest.approx(4 * 96 * 2048 * 12288 * 64 * 2048)


def _gpt3(*sets: str, world: int = 64):
    cfg = load_config(None, [*GPT3, *sets])
    return cfg, derive(cfg, world)


def test_recompute_adds_forward_time_and_full_adds_the_most():
    times = {}
    for level in ("none", "selective", "full"):
        cfg, d = _gpt3("parallel.tp=8", "parallel.pp=8", "parallel.dp=1",
                       f"train.activation_checkpointing={level}")  # fmt: skip
        times[level] = step_time(cfg, d, GPUS["H100"]).breakdown["compute"]
    assert times["none"] < times["selective"] < times["full"] < 1.4 * times["none"]


def test_overlap_hides_the_data_parallel_reduction_under_backward():
    # One micro-batch a step: its whole backward can hide the reduction.
    sets = ["parallel.tp=8", "parallel.dp=8", "train.global_batch_size=64",
            "train.micro_batch_size=8"]  # fmt: skip
    exposed = {}
    for overlap in ("true", "false"):
        cfg, d = _gpt3(*sets, "model.n_layer=8", f"optim.overlap_grad_reduce={overlap}")
        exposed[overlap] = step_time(cfg, d, GPUS["H100"]).breakdown["exposed_dp"]
    assert 0 < exposed["true"] < exposed["false"] / 2


def test_the_model_times_the_bytes_of_the_analytic_collective_count():
    cfg, d = _gpt3("parallel.tp=8", "parallel.pp=8", "parallel.dp=1")
    mesh, h100 = Mesh(tp=8, cp=1, dp=1, pp=8), GPUS["H100"]
    tp_ops = [op for op in collectives_per_step(cfg, d, 7) if op.group == "tp"]
    nodes = default_cluster(h100)
    tp_seconds = sum(collective_seconds(op, mesh, nodes, GPU_EFFICIENCY) for op in tp_ops)
    p = step_time(cfg, d, h100)
    assert p.breakdown["exposed_tp"] == pytest.approx(tp_seconds)  # the last stage is slowest
    bandwidth = h100.nvlink_gb_s * 1e9 * GPU_EFFICIENCY.nvlink_fraction
    assert tp_seconds > sum(op.sent for op in tp_ops) / bandwidth


def test_tp_comm_overlap_leaves_exposed_only_what_outlasts_its_gemm_chunk():
    from megatronish.accounting.collectives import Collective, Purpose, Split
    from megatronish.accounting.tp_overlap import split_seconds

    # 4 hops of 1 ms each under GEMMs of 8 ms at t = 4 (2 ms chunks): all hidden; of 3 ms: 1 ms
    # each exposed. 8 chunked all-reduces (two collectives at t = 4) of 1 ms under 2 ms chunks:
    # each collective's last chunk exposed.
    hops = Collective("x", "tp_ring", "tp", 4, 100, 4, Purpose.ACTIVATION, "qkv", Split.RING)
    assert split_seconds(hops, 4.0, 8.0, 4) == (0.0, 4.0)
    assert split_seconds(hops, 12.0, 8.0, 4) == (4.0, 8.0)
    chunks = Collective(
        "y", "all_reduce", "tp", 4, 100, 8, Purpose.ACTIVATION, "proj", Split.CHUNKS
    )
    assert split_seconds(chunks, 8.0, 8.0, 4) == (2.0, 6.0)


PAYS = [(8, "true", True), (4, "false", True), (8, "false", False)]


@pytest.mark.parametrize(("tp", "sp", "pays"), PAYS)
def test_the_model_tells_when_the_tp_overlap_pays_and_plan_json_reports_hidden_and_exposed(
    tp, sp, pays
):
    """Under sequence parallelism the ring hops move the bytes in the ring steps the
    collectives did, split into hidden and exposed; without it the t chunked all-reduces pay
    t times an all-reduce's latency, which at tp 8 costs more than it hides."""
    sets = [f"parallel.tp={tp}", f"parallel.dp={64 // tp}", f"parallel.sequence_parallel={sp}"]
    predicted = {}
    for overlap in ("false", "true"):
        cfg, d = _gpt3(*sets, "model.n_layer=8", f"parallel.tp_comm_overlap={overlap}")
        predicted[overlap] = step_time(cfg, d, GPUS["H100"])
    off, on = predicted["false"], predicted["true"]
    assert off.tp_hidden_s == 0 and on.tp_hidden_s > 0
    assert on.breakdown["compute"] == off.breakdown["compute"]
    assert (on.step_time_s < off.step_time_s) == pays
    assert (on.breakdown["exposed_tp"] < off.breakdown["exposed_tp"]) == pays
    if sp == "true":
        total = on.breakdown["exposed_tp"] + on.tp_hidden_s
        assert total == pytest.approx(off.breakdown["exposed_tp"])
    gpt3 = [a for s in GPT3 + sets + ["parallel.tp_comm_overlap=true"] for a in ("--set", s)]
    tiny = str(CONFIGS / "tiny.yaml")
    layout = ["--gpus", "64", "--gpu", "H100", "--layout", f"tp={tp} dp={64 // tp}", "--json"]
    result = invoke_cli("plan", "--config", tiny, *gpt3, *layout)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["layout"]["tp_comm_overlap"] is True
    assert record["tp_hidden_s"] > 0 and record["tp_exposed_s"] == record["breakdown"]["exposed_tp"]


def test_groups_inside_a_node_use_nvlink_and_the_others_the_network():
    mesh, h100 = Mesh(tp=8, cp=1, dp=4, pp=2), CLUSTERS["dgx-h100"]
    assert inside_node(mesh, "tp", 8, h100) and not inside_node(mesh, "dp", 4, h100)
    small = Mesh(tp=2, cp=1, dp=4, pp=1)
    assert inside_node(small, "dp", 4, h100) and not inside_node(small, "dp", 8, h100)


def _reduce_scatter_s(tp: int, cluster: str, dp: int = 48) -> float:
    op = Collective("g", "reduce_scatter", "dp", dp, 8 * 2**30, 1, Purpose.GRADIENT_REDUCTION)
    return collective_seconds(op, Mesh(tp=tp, cp=1, dp=dp, pp=1), CLUSTERS[cluster], GPU_EFFICIENCY)


def test_a_dp_group_gets_the_nics_of_its_ranks_in_a_node_and_pays_oversubscription_above_a_pod():
    # 8 ranks a node share the node's 8 NICs (bus bandwidth 8 x 50 GB/s, capped by NVLink's
    # 360); one rank a node gets its GPU's NIC: 50 x 0.9 = 45 GB/s.
    one, eight = _reduce_scatter_s(8, "dgx-h100"), _reduce_scatter_s(1, "dgx-h100")
    sent = 8 * 2**30 * 47 / 48
    assert one == pytest.approx(47 * 10e-6 + sent / 45e9)
    assert eight == pytest.approx(47 * 10e-6 + sent / 360e9)
    # 48 x 8 = 384 GPUs inside a 2,048-GPU zone: non-blocking; 384 x 8 above it: 1:7.
    assert _reduce_scatter_s(8, "grand-teton-h100-roce") == pytest.approx(one)
    far = _reduce_scatter_s(8, "grand-teton-h100-roce", dp=384)
    assert far == pytest.approx(383 * 10e-6 + 8 * 2**30 * 383 / 384 / (45e9 / 7))


def test_small_all_reduces_across_nodes_take_the_tree_and_sharp_sends_each_byte_once():
    mesh, eff = Mesh(tp=8, cp=1, dp=64, pp=1), GPU_EFFICIENCY
    small = Collective("flags", "all_reduce", "dp", 64, 16, 1, Purpose.AGREEMENT)
    ring = 2 * 63 * eff.network_latency_s
    tree = 2 * 6 * eff.network_latency_s + 2 * 16 / 45e9  # log2 64 nodes, one rank a node
    assert collective_seconds(small, mesh, CLUSTERS["dgx-h100"], eff) == pytest.approx(tree)
    assert tree < ring
    big = Collective("grads", "all_reduce", "dp", 64, 2**30, 1, Purpose.GRADIENT_REDUCTION)
    sharp = dataclasses.replace(CLUSTERS["dgx-h100"], sharp=True)
    plain = collective_seconds(big, mesh, CLUSTERS["dgx-h100"], eff)
    assert collective_seconds(big, mesh, sharp, eff) == pytest.approx(
        2 * eff.network_latency_s + 2**30 / 45e9
    )
    assert plain > 1.9 * (2**30 / 45e9)


def test_gemm_efficiency_follows_tiles_and_waves_and_causal_attention():
    a100 = GPUS["A100"]
    bw = a100.hbm_tb_s * 1e12
    # 8192 x 8192: 64 x 64 tiles of 128 x 128 in 37.9 waves of 108 SMs -> 38 waves.
    big, bound = gemm_time(8192, 8192, 8192, a100, 2, GPU_EFFICIENCY)
    filled = 4096 / (38 * 108)
    assert 2 * 8192**3 / big == pytest.approx(0.8 * filled * a100.peak_flops, rel=GEMM_OVERHEAD_REL)
    assert not bound
    ragged, _ = gemm_time(8192, 8192 + 1, 8192, a100, 2, GPU_EFFICIENCY)
    assert ragged > big * 1.01  # one more column costs a column of tiles
    skinny, bound = gemm_time(8, 8192, 8192, a100, 2, GPU_EFFICIENCY)
    assert bound and skinny > 8192 * 8192 * 2 / bw  # memory bound: reads the whole weight
    h100 = GPUS["H100"]
    fp8, _ = gemm_time(8192, 8192, 8192, h100, 2, GPU_EFFICIENCY, fp8=True)
    bf16, _ = gemm_time(8192, 8192, 8192, h100, 2, GPU_EFFICIENCY)
    assert bf16 / fp8 == pytest.approx(2.0, rel=GEMM_OVERHEAD_REL)  # 1979 against 989 TFLOP/s
    assert attention_flops(1, 8, 512, 512, 64, True) * 2 == attention_flops(
        1, 8, 512, 512, 64, False
    )


def test_a_sliding_window_counts_only_the_query_key_pairs_it_keeps():
    # Roofline: the causal pairs kept, sum over positions of min(i + 1, W) of s (s + 1) / 2.
    kept = sum(min(i + 1, 100) for i in range(512)) / (512 * 513 / 2)
    causal = attention_flops(1, 8, 512, 512, 64, True)
    assert attention_flops(1, 8, 512, 512, 64, True, 100) == pytest.approx(causal * kept)
    assert attention_flops(1, 8, 512, 512, 64, True, 512) == causal
    # Model FLOPs (MFU): each query against the min(s, W) keys it reaches, in the 6 layers of 8
    # that slide, instead of the whole sequence (Narayanan's s, not halved for causal).
    llama = ("model.arch=llama", "model.n_layer=8", "parallel.tp=8")
    plain = _gpt3(*llama, world=8)
    windowed = _gpt3(*llama, "model.sliding_window=512", "model.full_attention_layers=2", world=8)
    cfg, d = plain
    saved = 3 * d.tokens_per_step * 4 * cfg.model.n_head * d.head_dim * 6 * (2048 - 512)
    assert model_flops_per_step(*plain) - model_flops_per_step(*windowed) == saved
    # The predicted step spends less time in attention.
    assert (
        step_time(*windowed, GPUS["H100"]).step_time_s < step_time(*plain, GPUS["H100"]).step_time_s
    )


def test_the_four_gpus_have_every_figure():
    for name in ("A100", "H100", "H200", "B200"):
        gpu = device_named(name.lower())
        assert gpu.peak_tflops > 300 and gpu.hbm_tb_s >= 2 and gpu.nvlink_gb_s >= 300
        assert gpu.network_gb_s >= 25 and gpu.gpus_per_node == 8 and gpu.memory_gb >= 80


def test_cli_fixed_layout_prints_one_json_object(tmp_path):
    config = tmp_path / "gpt3.yaml"
    config.write_text(
        "model: {arch: gpt2, n_layer: 96, d_model: 12288, n_head: 96, vocab_size: 51200, "
        "max_seq_len: 2048}\ntrain: {seq_len: 2048, micro_batch_size: 1, "
        "global_batch_size: 1536, precision: bf16}\n"
    )
    result = invoke_cli("plan", "--config", str(config), "--gpus", "1536", "--gpu", "H100",
                        "--layout", "tp=8 pp=8 v=2 cp=1 dp=24", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
                "mfu", "hfu", "memory_gb", "breakdown"):  # fmt: skip
        assert key in record
    assert sum(record["breakdown"].values()) == pytest.approx(record["step_time_s"])
    assert record["layout"]["v"] == 2 and record["tokens_per_s"] == pytest.approx(
        1536 * 2048 / record["step_time_s"]
    )


def _one_line_error(result, *words: str) -> None:
    assert result.returncode == 2, result.stdout
    assert len(result.stderr.strip().splitlines()) == 1
    for word in words:
        assert word in result.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--gpu", "TPU9"], ["--gpu TPU9", "H100"]),
        (["--layout", "tp=8 pp=8 dp=2"], ["--layout", "not --gpus 1536"]),
        (["--gpus", "1280", "--layout", "tp=5 dp=256"], ["model.n_head", "valid tp"]),
        (["--layout", "tp=8 xp=2"], ["unknown key 'xp'", "valid: tp"]),
    ],
)
def test_cli_bad_plan_input_exits_2_with_one_line(args, words):
    sets = [a for s in GPT3 for a in ("--set", s)]
    base = ["plan", "--config", str(CONFIGS / "tiny.yaml"), *sets, "--gpus", "1536"]
    _one_line_error(invoke_cli(*base, *args), *words)


def test_cli_device_file_with_a_missing_field_exits_2(tmp_path):
    device = tmp_path / "mygpu.yaml"
    device.write_text("peak_tflops: 500\nmemory_gb: 96\nhbm_tb_s: 4\nnvlink_gb_s: 450\n"
                      "network_gb_s: 50\n")  # fmt: skip
    args = ["plan", "--config", str(CONFIGS / "tiny.yaml"), "--set", "model.vocab_size=257"]
    _one_line_error(invoke_cli(*args, "--gpu", str(device)), "missing gpus_per_node")
    device.write_text(device.read_text() + "gpus_per_node: 4\n")
    assert invoke_cli(*args, "--gpu", str(device), "--gpus", "4").returncode == 0


def test_cli_device_file_count_that_is_not_a_whole_number_exits_2_naming_it(tmp_path):
    from megatronish.accounting.hardware import load_device
    from megatronish.errors import UserError

    device = tmp_path / "mygpu.yaml"
    fields = "peak_tflops: 500\nmemory_gb: 96\nhbm_tb_s: 4\nnvlink_gb_s: 450\nnetwork_gb_s: 50\n"
    for bad in ("sms: 1.5", "tile: 0", "tile_n: true"):
        device.write_text(fields + "gpus_per_node: 4\n" + bad + "\n")
        with pytest.raises(UserError, match=f"{bad.split(':')[0]}: .* is not an integer >= 1"):
            load_device(device)
    device.write_text(fields + "gpus_per_node: 0.5\n")
    args = ["plan", "--config", str(CONFIGS / "tiny.yaml"), "--set", "model.vocab_size=257"]
    result = invoke_cli(*args, "--gpu", str(device), "--gpus", "4")
    _one_line_error(result, "gpus_per_node: 0.5 is not an integer >= 1")


CALIBRATION = {
    "cores": 2,
    "threads": {
        n: {
            "matmul_flops": 5e10 * int(n),
            "gemm_fraction": 0.6,
            "attention_fraction": 0.3,
            "memory_bytes_s": 1e10,
            "op_overhead_s": 5e-6,
        }
        for n in ("1", "2")
    },  # fmt: skip
    "shm_latency_s": 2e-5,
    "shm_bytes_s": 4e9,
    "gloo_latency_s": 1e-4,
    "gloo_bytes_s": 1e9,
}


def test_cli_cpu_plan_reads_a_fixed_calibration(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    args = ["plan", "--config", str(CONFIGS / "tiny.yaml"), "--set", "model.vocab_size=257",
            "--device", "cpu", "--calibration", str(path), "--gpus", "2"]  # fmt: skip
    one = {}
    for layout in ("tp=2", "dp=2", "pp=2"):
        result = invoke_cli(*args, "--layout", layout, "--json")
        assert result.returncode == 0, result.stderr
        one[layout] = json.loads(result.stdout)
    # One thread a rank: 5e10 FLOP/s; tp and pp pay their collectives, dp its all-reduce.
    assert (
        one["tp=2"]["breakdown"]["exposed_tp"] > 0
        and one["pp=2"]["breakdown"]["pipeline_sends"] > 0
    )
    assert one["dp=2"]["mfu"] == pytest.approx(one["dp=2"]["model_tflops_per_gpu"] * 1e12 / 5e10)
    report = invoke_cli(*args)
    assert report.returncode == 0 and "recommended:" in report.stdout


def test_plan_labels_every_figure_with_its_unit_and_scope():
    result = invoke_cli("plan", "--config", str(CONFIGS / "gpt2-1.3b.yaml"), "--gpus", "8")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "GiB (2^30 bytes) per rank" in text and "GiB a rank sends per step" in text
    assert "predicted seconds per step" in text and "ms per step" in text
    assert "comm GB" not in text


def test_fixed_layout_uses_the_configs_micro_batch_and_recompute():
    from megatronish.commands.plan import fixed_layout, target

    cfg = load_config(
        None, [*GPT3, "train.micro_batch_size=2", "train.activation_checkpointing=full"]
    )
    row = fixed_layout(cfg, 1024, "tp=8 pp=8 v=2 dp=16", target("H100", None, "gpu", None, 1024))
    assert row.cfg.train.micro_batch_size == 2 and row.memory.activation_checkpointing == "full"
    assert dataclasses.asdict(row.cfg.parallel)["pp_virtual"] == 2


def test_plan_compute_grows_with_mtp_depth_as_its_model_flops_do():
    """Each multi-token prediction module adds to the last stage a layer, eh_proj and the
    output layer again: the compute grows by the same time per depth, at about the FLOP rate
    of the rest of the model at tp 1 (both are mostly the same GEMMs; within 25%; eh_proj is
    replicated over tp ranks)."""
    compute, flops = [], []
    for depth in (0, 1, 2):
        cfg, d = _gpt3("model.n_layer=8", "parallel.dp=1", f"model.mtp_depth={depth}", world=1)
        p = step_time(cfg, d, GPUS["H100"])
        compute.append(p.breakdown["compute"])
        flops.append(p.model_flops)
    assert compute[0] < compute[1] < compute[2]
    assert compute[2] - compute[1] == pytest.approx(compute[1] - compute[0], rel=FP64_REORDER)
    rate, added_rate = flops[0] / compute[0], (flops[1] - flops[0]) / (compute[1] - compute[0])
    assert 0.8 < added_rate / rate < 1.25


def test_latent_attention_times_its_value_head_dim_apart_from_the_query_key_one():
    """q k^T runs over the query-key head dim (192 in DeepSeek-V3), p v over the value head
    dim: the attention core's time is proportional to their sum, 2 (d + d_v) per pair."""
    from megatronish.accounting.layer_time import layer_time

    times = {}
    for v in (64, 128):
        cfg = load_config(CONFIGS / "deepseek-v3.yaml", [f"model.mla.v_head_dim={v}"])
        d = derive(cfg, 256)
        times[v] = layer_time(cfg, d, GPUS["H100"], GPU_EFFICIENCY, False, "flash")
    overhead = GPU_EFFICIENCY.kernel_overhead_s  # one kernel, whatever its FLOPs
    ratio = (times[128].attention_forward - overhead) / (times[64].attention_forward - overhead)
    assert ratio == pytest.approx((192 + 128) / (192 + 64), rel=FP64_REORDER)
    assert attention_flops(1, 2, 8, 8, 192, False, None, 128) == 2 * 2 * 64 * (192 + 128)
