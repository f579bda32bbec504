"""Config: strict loading, typed overrides, derived sizes, and one-line errors (exit 2)."""

from __future__ import annotations

import pytest
import torch
import yaml

from megatronish.config import config_from_dict, derive, load_config, padded_vocab
from megatronish.distributed.layout import ParallelState
from megatronish.errors import UserError
from megatronish.model import GPT
from tests.conftest import CONFIGS, invoke_cli, run_cli


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_set_overrides_are_typed_by_the_field_and_win_over_the_file(tmp_path):
    cfg = load_config(
        write(tmp_path, "train:\n  lr: 1.0e-3\n  steps: 5\n"),
        ["train.steps=7", "train.lr=3e-4", "model.tie_embeddings=false", "model.d_ff=null"],
    )
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 3e-4 and cfg.model.tie_embeddings is False and cfg.model.d_ff is None


def test_unknown_key_suggests_the_nearest_valid_key(tmp_path):
    with pytest.raises(UserError, match=r"unknown key 'train.setps'; did you mean 'train.steps'"):
        load_config(write(tmp_path, "train:\n  setps: 3\n"))
    with pytest.raises(UserError, match=r"did you mean 'model.n_head'"):
        load_config(None, ["model.n_heads=4"])


def test_derived_sizes_are_computed_in_one_place():
    cfg = load_config(
        None, ["parallel.tp=2", "train.micro_batch_size=2", "train.global_batch_size=16"]
    )
    d = derive(cfg, world_size=8, vocab_size=257)
    assert (d.dp, d.grad_accum_steps, d.padded_vocab_size) == (4, 2, 512)
    assert padded_vocab(50257, 1) == 50304 and padded_vocab(50257, 4) == 50688
    llama = derive(
        load_config(None, ["model.arch=llama", "model.d_model=4096", "model.n_head=32"]), 1, 100
    )
    assert llama.d_ff == 11008 and not llama.tie_embeddings


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.tp=3"], 3, "model.n_head: 4 is not divisible by parallel.tp=3"),
        (
            ["parallel.tp=2", "parallel.dp=2"],
            2,
            "world size 2 != parallel.tp * parallel.cp * parallel.dp",
        ),
        (["train.global_batch_size=12", "train.micro_batch_size=8"], 1, "train.global_batch_size"),
        (["model.arch=llama", "model.n_kv_head=3"], 1, "model.n_kv_head: 3 does not divide"),
        (
            ["parallel.tp=2", "parallel.tp_comm_overlap=true", "train.seq_len=127"],
            2,
            "train.seq_len: 127 / parallel.cp=1 must be divisible by parallel.tp=2 with "
            "parallel.tp_comm_overlap",
        ),
    ],
)
def test_cross_checks_name_the_keys(overrides, world, message):
    with pytest.raises(UserError, match=message.replace("*", r"\*")):
        derive(load_config(None, overrides), world, vocab_size=257)


def test_seq_len_longer_than_max_seq_len_is_an_error():
    with pytest.raises(UserError, match="train.seq_len: 512 is longer than model.max_seq_len=256"):
        load_config(None, ["train.seq_len=512"])


def one_line_error(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_unknown_key_exits_2_with_one_line(tmp_path):
    # In a real process; the other CLI errors run in this one (invoke_cli), for speed.
    path = write(tmp_path, "model:\n  n_layr: 2\n")
    one_line_error(run_cli("check", "--config", str(path)), "model.n_layr", "model.n_layer")


def test_cli_tp_not_dividing_n_head_exits_2(tmp_path):
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), "--set", "parallel.tp=3")
    one_line_error(result, "model.n_head", "parallel.tp=3")


def test_cli_world_size_mismatch_exits_2():
    tiny = str(CONFIGS / "tiny.yaml")
    one_line_error(
        invoke_cli("check", "--config", tiny, "--set", "parallel.tp=2", "--world-size", "3"),
        "world size 3",
    )
    result = invoke_cli(
        "train", "--config", tiny, "--set", "parallel.tp=2", env={"WORLD_SIZE": "3"}
    )
    one_line_error(result, "world size 3")


def test_cli_missing_config_file_exits_2(tmp_path):
    one_line_error(invoke_cli("train", "--config", str(tmp_path / "nope.yaml")), "nope.yaml")


def test_cli_a_directory_as_config_file_exits_2_saying_it_is_a_directory():
    one_line_error(
        invoke_cli("train", "--config", str(CONFIGS)),
        f"config file {CONFIGS}: is a directory",
        "YAML file",
    )


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1" + "0" * 400])  # 1e400: no float
def test_cli_a_non_finite_number_in_the_yaml_exits_2_naming_the_key(tmp_path, value):
    path = write(tmp_path, f"model:\n  rope_theta: {value}\n")
    one_line_error(invoke_cli("check", "--config", str(path)), "model.rope_theta", "finite number")


def test_cli_non_numeric_value_exits_2(tmp_path):
    tiny = str(CONFIGS / "tiny.yaml")
    one_line_error(
        invoke_cli("check", "--config", tiny, "--set", "train.lr=fast"), "train.lr", "number"
    )
    path = write(tmp_path, "train:\n  steps: many\n")
    one_line_error(invoke_cli("check", "--config", str(path)), "train.steps", "integer")


def test_cli_bad_yaml_and_bad_choice_exit_2(tmp_path):
    one_line_error(invoke_cli("check", "--config", str(write(tmp_path, "model: [1,\n"))), "YAML")
    tiny = str(CONFIGS / "tiny.yaml")
    one_line_error(
        invoke_cli("check", "--config", tiny, "--set", "model.arch=bert"), "gpt2 | llama"
    )


def test_cli_check_prints_resolved_config_and_derived_sizes():
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), "--set", "parallel.tp=2")
    assert result.returncode == 0, result.stderr
    for needle in ("parameters:", "gradient accumulation steps: 2", "padded to 512", "ok"):
        assert needle in result.stdout


def test_cli_check_says_which_tp_collectives_are_decomposed_under_the_gemms():
    tiny, overlap = str(CONFIGS / "tiny.yaml"), "parallel.tp_comm_overlap=true"
    sets = ["--set", "parallel.tp=2", "--set", overlap]
    for sp, decomposed, whole in [
        ("true", "1 ring hop of a 1/2 sequence chunk", "embedding output gradient (backward)"),
        ("false", "2 all-reduces of a 1/2 sequence chunk", "qkv input gradient (backward)"),
    ]:
        result = invoke_cli(
            "check", "--config", tiny, *sets, "--set", f"parallel.sequence_parallel={sp}"
        )
        assert result.returncode == 0, result.stderr
        under, left = [x for x in result.stdout.splitlines() if x.startswith("tp co")]
        assert decomposed in under and "attention projection output (forward)" in under
        assert whole in left and whole not in under
    result = invoke_cli("check", "--config", tiny, *sets, "--set", "train.seq_len=127")
    one_line_error(result, "train.seq_len: 127", "parallel.tp=2", "parallel.tp_comm_overlap")


def test_tp_comm_overlap_at_tp1_is_a_no_op_said_once(dataset, tmp_path):
    note = "parallel.tp_comm_overlap: no effect at parallel.tp=1"
    sets = ["parallel.tp_comm_overlap=true", "train.steps=1", "model.n_layer=1"]
    sets += [f"data.path={dataset}", f"run.out_dir={tmp_path}", "checkpoint.save=false"]
    args = ["--config", str(CONFIGS / "tiny.yaml"), *(x for s in sets for x in ("--set", s))]
    for command in ("check", "train"):
        result = invoke_cli(command, *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count(note) == 1, command


def test_cli_train_of_a_parallel_config_in_one_process_says_how_to_launch():
    result = invoke_cli("train", "--config", str(CONFIGS / "tiny-tp2.yaml"))
    one_line_error(result, "needs 2 processes", "megatronish launch")


def test_cli_launch_checks_the_config_before_starting_ranks():
    result = invoke_cli("launch", "--config", str(CONFIGS / "tiny.yaml"), "--set", "parallel.tp=3")
    one_line_error(result, "model.n_head: 4 is not divisible by parallel.tp=3")


def test_cli_null_for_a_string_key_and_a_world_size_below_1_exit_2(tmp_path):
    path = write(tmp_path, "checkpoint:\n  resume: null\n")
    one_line_error(
        invoke_cli("check", "--config", str(path)), "checkpoint.resume: null is not valid"
    )
    tiny = str(CONFIGS / "tiny.yaml")
    one_line_error(invoke_cli("check", "--config", tiny, "--world-size", "0"), "--world-size 0")
    one_line_error(
        invoke_cli("plan", "--config", tiny, "--set", "model.vocab_size=257", "--gpus", "0"),
        "--gpus 0",
    )


def test_cli_triton_backend_without_gpu_or_interpreter_exits_2_before_writing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the triton backend is valid here")
    out = tmp_path / "run"
    result = invoke_cli(
        "train", "--config", str(CONFIGS / "tiny.yaml"), "--set", "kernels.backend=triton",
        "--set", f"run.out_dir={out}", env={"TRITON_INTERPRET": "0"},
    )  # fmt: skip
    one_line_error(result, "kernels.backend", "valid here: auto, torch")
    assert not out.exists()


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_passes_check_and_plan_as_shipped(config):
    for command in ("check", "plan"):
        result = invoke_cli(command, "--config", str(CONFIGS / config))
        assert result.returncode == 0, (command, result.stderr)


HEAD_DIM_MODEL = [
    *("--set", "model.arch=llama", "--set", "model.n_head=8", "--set", "model.n_kv_head=4"),
    *("--set", "model.d_model=32", "--set", "model.vocab_size=512"),
]


def test_cli_check_counts_the_parameters_of_a_model_whose_head_dim_is_not_d_model_per_head():
    tiny = str(CONFIGS / "tiny.yaml")
    result = invoke_cli("check", "--config", tiny, *HEAD_DIM_MODEL, "--set", "model.head_dim=6")
    assert result.returncode == 0, result.stderr
    cfg = load_config(
        CONFIGS / "tiny.yaml", [a for a in HEAD_DIM_MODEL if a != "--set"] + ["model.head_dim=6"]
    )
    numel = sum(p.numel() for p in GPT(cfg, derive(cfg, 1), ParallelState.single()).parameters())
    assert f"parameters: {numel:,} " in result.stdout
    assert "(head dim 6)" in result.stdout


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["model.head_dim=7"], "positive even integer"),
        (["model.head_dim=0"], "must be >= 1"),
        (["model.head_dim=-2"], "must be >= 1"),
        (["model.arch=gpt2", "model.n_kv_head=null", "model.head_dim=8"], "gpt2 uses"),
    ],
)
def test_cli_a_bad_head_dim_exits_2_in_one_line_naming_the_key(sets, needle):
    args = [a for s in sets for a in ("--set", s)]
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), *HEAD_DIM_MODEL, *args)
    one_line_error(result, "model.head_dim", needle)


@pytest.mark.parametrize(
    "keys", [["model.qkv_bias"], ["model.qk_norm"], ["model.qkv_bias", "model.qk_norm"]]
)
def test_cli_check_counts_the_parameters_of_a_model_with_qwen_attention(keys):
    tiny, sets = str(CONFIGS / "tiny.yaml"), ["model.head_dim=6", *(f"{k}=true" for k in keys)]
    result = invoke_cli(
        "check", "--config", tiny, *HEAD_DIM_MODEL, *(a for s in sets for a in ("--set", s))
    )
    assert result.returncode == 0, result.stderr
    cfg = load_config(CONFIGS / "tiny.yaml", [a for a in HEAD_DIM_MODEL if a != "--set"] + sets)
    numel = sum(p.numel() for p in GPT(cfg, derive(cfg, 1), ParallelState.single()).parameters())
    assert f"parameters: {numel:,} " in result.stdout


@pytest.mark.parametrize("key", ["model.qkv_bias", "model.qk_norm"])
def test_cli_a_qwen_attention_option_on_gpt2_exits_2_in_one_line_naming_the_key(key):
    sets = ("--set", "model.arch=gpt2", "--set", f"{key}=true")
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), *sets)
    one_line_error(result, key, "only with RoPE families")


@pytest.mark.parametrize(
    "sets, key, needle",
    [
        (["model.sliding_window=0"], "model.sliding_window", "must be a positive integer"),
        (
            ["model.arch=gpt2", "model.n_kv_head=null", "model.sliding_window=8"],
            "model.sliding_window",
            "only for llama",
        ),
        (
            ["model.sliding_window=8", "model.full_attention_layers=3"],
            "model.full_attention_layers",
            "must be 0 to model.n_layer=2",
        ),
        (["model.sliding_window=8", "model.full_attention_layers=-1"], "full_attention", "0 to"),
        (["model.full_attention_layers=1"], "model.full_attention_layers", "model.sliding_window"),
        (
            ["model.layer_types=[sliding_attention, full_attention]"],
            "model.layer_types",
            "needs model.sliding_window",
        ),
        (
            ["model.layer_types=[sliding_attention, full_attention]", "model.sliding_window=4"]
            + ["model.full_attention_layers=1"],
            "model.full_attention_layers",
            "not used with model.layer_types",
        ),
    ],
)
def test_cli_a_bad_sliding_window_exits_2_in_one_line_naming_the_key(sets, key, needle):
    args = [a for s in ["model.n_layer=2", *sets] for a in ("--set", s)]
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), *HEAD_DIM_MODEL, *args)
    one_line_error(result, key, needle)


def test_the_sliding_window_follows_the_global_block_index_and_the_named_layer_types():
    from megatronish.config import attention_window

    sets = ["model.arch=llama", "model.n_layer=4", "model.sliding_window=6"]
    pattern = load_config(None, [*sets, "model.full_attention_layers=1"]).model
    assert [attention_window(pattern, i) for i in range(4)] == [None, 6, 6, 6]
    assert [attention_window(load_config(None, sets).model, i) for i in range(4)] == [6] * 4
    assert attention_window(load_config(None, sets[:2]).model, 3) is None
    types = (
        "model.layer_types=[sliding_attention, full_attention, sliding_attention, full_attention]"
    )
    named = load_config(None, [*sets, types]).model
    assert [attention_window(named, i) for i in range(4)] == [6, None, 6, None]


def test_a_head_dim_the_triton_attention_kernels_do_not_compile_for_is_a_user_error():
    sets = [a for a in HEAD_DIM_MODEL if a != "--set"] + ["kernels.backend=triton"]
    assert derive(load_config(CONFIGS / "tiny.yaml", sets + ["model.head_dim=16"]), 1)
    with pytest.raises(UserError, match="model.head_dim: 24 .*valid head dims: 16, 32, 64, 128"):
        derive(load_config(CONFIGS / "tiny.yaml", sets + ["model.head_dim=24"]), 1)


def test_auto_backend_runs_attention_on_torch_for_a_head_dim_the_kernels_do_not_compile(
    monkeypatch,
):
    from megatronish import ops

    monkeypatch.setattr(ops, "resolve_backend", lambda backend, x: "triton")  # as on a GPU
    called = []
    kernels = type("Kernels", (), {"attention": staticmethod(lambda *a, **k: called.append(a))})
    monkeypatch.setattr(ops, "_kernels", lambda: kernels)
    q = torch.randn(1, 2, 4, 24)
    torch.testing.assert_close(ops.attention(q, q, q), ops.reference.attention(q, q, q, True))
    assert called == [] and ops.attention_backend("triton", q) == "triton"
    ops.attention(*[torch.randn(1, 2, 4, 16)] * 3)
    assert len(called) == 1  # a head dim of 16 runs on the kernel


LLAMA3 = dict(
    type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
YARN = "model.rope_scaling={type: yarn, factor: 4, original_max_position_embeddings: 64}"


def test_rope_scaling_round_trips_through_a_saved_config_with_only_its_types_keys():
    keys = [f"model.rope_scaling.{k}={v}" for k, v in LLAMA3.items()]  # one key at a time
    llama3 = load_config(None, ["model.arch=llama", *keys])
    yarn = load_config(None, ["model.arch=llama", YARN])  # a YAML mapping
    assert llama3.to_dict()["model"]["rope_scaling"] == LLAMA3
    assert yarn.to_dict()["model"]["rope_scaling"] == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,  # transformers' defaults, written out
        "beta_slow": 1.0,
        "attention_factor": None,
        "mscale": None,
        "mscale_all_dim": None,
        "truncate": True,
    }
    for cfg in (llama3, yarn):  # as a checkpoint's config.yaml is written and read
        assert config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    off = load_config(None, ["model.arch=llama", YARN, "model.rope_scaling=null"])
    assert off.model.rope_scaling is None and off.to_dict()["model"]["rope_scaling"] is None
    tiny = str(CONFIGS / "tiny.yaml")
    shown = invoke_cli("check", "--config", tiny, "--set", "model.arch=llama", "--set", YARN)
    assert "  rope_scaling:\n    type: yarn\n    factor: 4.0\n" in shown.stdout, shown.stderr


BAD_ROPE_SCALING = [  # (--set values, the key the line names, what it says)
    (["model.rope_scaling={type: ntk, factor: 2}"], "type", "valid: linear | llama3 | yarn"),
    (["model.rope_scaling.factor=2"], "type", "missing"),
    (["model.rope_scaling={type: yarn}"], "factor", "missing; type yarn needs factor"),
    ([YARN, "model.rope_scaling.factor=0.5"], "factor", "must be >= 1"),
    ([YARN, "model.rope_scaling.rope_type=yarn"], "rope_type", "did you mean"),
    ([YARN, "model.rope_scaling.low_freq_factor=1"], "low_freq_factor", "not a key of type yarn"),
    ([YARN, "model.rope_scaling.beta_fast=0.5"], "beta_fast", "must be > beta_slow=1.0"),
    ([YARN, "model.rope_scaling=8"], "", "expected null"),
    ([YARN, "model.arch=gpt2"], "", "only with RoPE families"),
]


@pytest.mark.parametrize("sets, key, needle", BAD_ROPE_SCALING)
def test_cli_a_bad_rope_scaling_exits_2_in_one_line_naming_the_key(sets, key, needle):
    args = [a for s in ["model.arch=llama", *sets] for a in ("--set", s)]
    result = invoke_cli("check", "--config", str(CONFIGS / "tiny.yaml"), *args)
    one_line_error(result, f"model.rope_scaling{'.' + key if key else ''}", needle)


LINEAR_HYBRID = [
    "model.layer_types=[linear_attention, full_attention]",
    "model.n_layer=2",
    "model.head_dim=16",
    "kernels.backend=triton",
]


@pytest.mark.parametrize(
    "dims, key",
    [((8, 16), "model.linear_key_head_dim: 8"), ((16, 12), "model.linear_value_head_dim: 12")],
)
def test_triton_backend_refuses_linear_head_dims_the_gated_delta_kernels_do_not_take(
    dims, key, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels are taken on CPU too
    sizes = [f"model.linear_key_head_dim={dims[0]}", f"model.linear_value_head_dim={dims[1]}"]
    sets = [a for s in LINEAR_HYBRID + sizes for a in ("--set", s)]
    config = ["--config", str(CONFIGS / "tiny-qwen3_5.yaml")]
    one_line_error(invoke_cli("check", *config, *sets), key, "kernels.backend=triton", "16, 32")
    valid = [a for s in LINEAR_HYBRID for a in ("--set", s)]
    assert invoke_cli("check", *config, *valid).returncode == 0
