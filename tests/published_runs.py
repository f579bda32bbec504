"""Published large training runs the step-time model (megatronish.accounting.step_time) is
checked against, as data with their sources, and the model's prediction for each.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21), Table 1: GPT models on Selene (DGX A100 80GB, 8 GPUs a node, 8 x 200 Gb/s
HDR InfiniBand a node), sequence 2048, vocabulary 51,200, fp16, full activation recomputation,
dropout 0.1. The layouts, micro-batches and virtual stages are Megatron-LM's
examples/sc21/run_table_1.sh: `--num-layers-per-virtual-pipeline-stage` 5 (76B: v = 3, 145B:
v = 2), 3 (310B: v = 2), 1 (530B: v = 3), none for the 1T row (we assume v = 1, as the script
sets, although the paper says every row is interleaved). The script's DDP=torch rows (up to
18B) overlap the data-parallel all-reduce with backward (torch DDP's buckets); its DDP=local
rows all-reduce after backward. TFLOP/s per GPU count hardware FLOPs, the paper's eq. (3):
F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h)) per iteration.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Tables 3 and 5 ("present work": sequence parallelism + selective recompute): Selene, sequence
2048, vocabulary 51,200, tp 8, dp 1, 175B and 530B interleaved with 3 chunks a stage; the
iteration time in seconds and MFU (model FLOPs, no recompute). Local DDP (dp = 1 anyway).

Megatron-LM of both papers computed attention with the scores in memory (fused
scale-mask-softmax and dropout, before flash attention): the model times it "materialized".
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.accounting.hardware import GPUS
from megatronish.accounting.step_time import StepTime, step_time
from megatronish.config import derive, load_config


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    virtual: int
    recompute: str
    sequence_parallel: bool
    overlap_dp: bool
    tflops_per_gpu: float | None = None
    """Published hardware TFLOP/s per GPU (Narayanan, eq. 3)."""
    iteration_s: float | None = None
    mfu: float | None = None


NARAYANAN = "Narayanan et al. 2021, Table 1"
KORTHIKANTI = "Korthikanti et al. 2022, Tables 3 and 5"


def _sc21(name, heads, hidden, layers, tp, pp, gpus, batch, micro, virtual, ddp, tflops):
    return PublishedRun(name, NARAYANAN, heads, hidden, layers, tp, pp, gpus, batch, micro,
                        virtual, "full", False, ddp == "torch", tflops_per_gpu=tflops)  # fmt: skip


def _sp(name, heads, hidden, layers, pp, virtual, iteration_s, mfu):
    gpus = 8 * pp
    return PublishedRun(name, KORTHIKANTI, heads, hidden, layers, 8, pp, gpus,
                        {1: 4}.get(pp, gpus), {1: 4}.get(pp, 1), virtual, "selective", True,
                        False, iteration_s=iteration_s, mfu=mfu)  # fmt: skip


RUNS = [
    _sc21("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, "torch", 137),
    _sc21("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, "torch", 138),
    _sc21("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, "torch", 142),
    _sc21("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, "torch", 135),
    _sc21("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, "local", 138),
    _sc21("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, "local", 140),
    _sc21("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, "local", 148),
    _sc21("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, "local", 155),
    _sc21("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, "local", 163),
    _sc21("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, "local", 163),
    _sp("22B", 64, 6144, 48, 1, 1, 1.10, 0.415),
    _sp("175B", 96, 12288, 96, 8, 3, 13.75, 0.514),
    _sp("530B", 128, 20480, 105, 35, 3, 37.83, 0.560),
    _sp("1T", 160, 25600, 128, 64, 1, 71.49, 0.563),
]


def config_of(run: PublishedRun):
    """The megatronish config and derived layout of a published run."""
    sets = [
        "model.arch=gpt2", f"model.n_layer={run.layers}", f"model.n_head={run.heads}",
        f"model.d_model={run.hidden}", "model.vocab_size=51200", "model.max_seq_len=2048",
        "model.dropout=0.1", "train.seq_len=2048", f"train.micro_batch_size={run.micro_batch}",
        f"train.global_batch_size={run.batch}", "train.precision=bf16",
        f"train.activation_checkpointing={run.recompute}", f"parallel.tp={run.tp}",
        f"parallel.pp={run.pp}", f"parallel.pp_virtual={run.virtual}",
        f"parallel.dp={run.gpus // (run.tp * run.pp)}",
        f"parallel.sequence_parallel={str(run.sequence_parallel).lower()}", "optim.zero=0",
        f"optim.overlap_grad_reduce={str(run.overlap_dp).lower()}",
    ]  # fmt: skip
    cfg = load_config(None, sets)
    return cfg, derive(cfg, run.gpus)


def narayanan_flops(run: PublishedRun) -> float:
    """Eq. (3) of Narayanan et al. 2021: hardware FLOPs per iteration."""
    B, s, l, h, V = run.batch, 2048, run.layers, run.hidden, 51200  # noqa: E741
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def predict(run: PublishedRun) -> StepTime:
    cfg, d = config_of(run)
    return step_time(cfg, d, GPUS["A100"], attention="materialized")


def compare(run: PublishedRun) -> tuple[str, float, float]:
    """(what is compared, published, predicted) for a run: TFLOP/s per GPU by eq. (3)
    (Narayanan) or MFU in % (Korthikanti)."""
    predicted = predict(run)
    if run.tflops_per_gpu is not None:
        tflops = narayanan_flops(run) / predicted.step_time_s / run.gpus / 1e12
        return "hardware TFLOP/s per GPU", run.tflops_per_gpu, tflops
    return "MFU %", 100 * run.mfu, 100 * predicted.mfu
