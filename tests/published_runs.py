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

Megatron-LM's README, "Performance Benchmarking" (Megatron-Core r0.8.0; images
model_table.png, weak_scaling.png, strong_scaling.png): GPT models on DGX H100 (8 GPUs a node
on NVLink / NVSwitch, 8 x 400 Gb/s NDR InfiniBand a node), vocabulary 131,072, sequence 4,096,
bf16, "fine-grained overlapping with DP (--overlap-grad-reduce, --overlap-param-gather), TP
(--tp-comm-overlap), and PP"; model TFLOP/s per GPU (MFU against the dense bf16 989 TFLOP/s),
end to end. Weak scaling: nine models from 1.7B on 48 GPUs to 462B on 6,144, dp 48 each.
Strong scaling: the 177B model at a fixed batch of 1,152 from 96 to 4,608 GPUs, MFU 47% falling
to 42%; the layout per point is not printed: tp 8 x pp 6 as in the weak-scaling row (dp 2 at
96 GPUs, dp 96 at 4,608). The README does not print the micro-batch, recompute or virtual
stages; we assume what the Megatron-LM examples of that release use: micro-batch 1, no
recompute (flash attention keeps no scores), the distributed optimizer (ZeRO-1), sequence
parallelism at tp > 1, dropout 0.1 (Megatron's default), and the interleaved schedule with
the most chunks a stage whose layers divide evenly, at most V_MAX (Megatron's examples
interleave large pipelines; 23 layers a stage, the 119B's, only v = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.accounting.cluster import CLUSTERS
from megatronish.accounting.hardware import GPUS
from megatronish.accounting.step_time import StepTime, step_time
from megatronish.config import derive, load_config

V_MAX = 4  # the most model chunks a stage the H100 rows assume (see module doc)


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
    """Published TFLOP/s per GPU: hardware FLOPs by Narayanan's eq. (3), or model FLOPs
    (Megatron-LM's README)."""
    iteration_s: float | None = None
    mfu: float | None = None
    gpu: str = "A100"
    cluster: str = "dgx-a100-selene"
    seq: int = 2048
    vocab: int = 51200
    attention: str = "materialized"
    tp_overlap: bool = False
    zero: int = 0

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


NARAYANAN = "Narayanan et al. 2021, Table 1"
KORTHIKANTI = "Korthikanti et al. 2022, Tables 3 and 5"
WEAK = "Megatron-LM README, weak scaling (H100)"
STRONG = "Megatron-LM README, strong scaling of the 177B (H100)"


def _sc21(name, heads, hidden, layers, tp, pp, gpus, batch, micro, virtual, ddp, tflops):
    return PublishedRun(
        name, NARAYANAN, heads, hidden, layers, tp, pp, gpus, batch, micro, virtual, "full",
        False, ddp == "torch", tflops_per_gpu=tflops,
    )  # fmt: skip


def _sp(name, heads, hidden, layers, pp, virtual, iteration_s, mfu):
    gpus = 8 * pp
    return PublishedRun(
        name, KORTHIKANTI, heads, hidden, layers, 8, pp, gpus, {1: 4}.get(pp, gpus),
        {1: 4}.get(pp, 1), virtual, "selective", True, False, iteration_s=iteration_s, mfu=mfu,
    )  # fmt: skip


def _interleave(layers: int, pp: int) -> int:
    """The most chunks (at most V_MAX) a stage's layers split into evenly (1 at pp = 1)."""
    if pp == 1:
        return 1
    return max(v for v in range(1, V_MAX + 1) if layers % (pp * v) == 0)


def _h100(name, source, heads, hidden, layers, tp, pp, gpus, batch, tflops=None, mfu=None):
    return PublishedRun(
        name, source, heads, hidden, layers, tp, pp, gpus, batch, 1, _interleave(layers, pp),
        "none", tp > 1, True, tflops_per_gpu=tflops, mfu=mfu, gpu="H100", seq=4096,
        vocab=131072, attention="flash", tp_overlap=True, zero=1, cluster="dgx-h100",
    )  # fmt: skip


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
    _h100("1.7B", WEAK, 16, 2048, 24, 1, 1, 48, 192, tflops=408.8),
    _h100("7.1B", WEAK, 32, 4096, 30, 2, 1, 96, 192, tflops=465.9),
    _h100("16B", WEAK, 48, 6144, 32, 4, 1, 192, 192, tflops=489.1),
    _h100("32B", WEAK, 56, 7168, 48, 8, 1, 384, 192, tflops=459.6),
    _h100("70B", WEAK, 64, 8192, 84, 8, 2, 768, 384, tflops=419.7),
    _h100("119B", WEAK, 80, 10240, 92, 8, 4, 1536, 768, tflops=420.5),
    _h100("177B", WEAK, 96, 12288, 96, 8, 6, 2304, 1152, tflops=432.8),
    _h100("314B", WEAK, 128, 16384, 96, 8, 8, 3072, 1536, tflops=474.4),
    _h100("462B", WEAK, 144, 18432, 112, 8, 16, 6144, 3072, tflops=459.9),
    _h100("177B on 96", STRONG, 96, 12288, 96, 8, 6, 96, 1152, mfu=0.47),
    _h100("177B on 4608", STRONG, 96, 12288, 96, 8, 6, 4608, 1152, mfu=0.42),
]


def config_of(run: PublishedRun):
    """The megatronish config and derived layout of a published run."""
    sets = [
        "model.arch=gpt2",
        f"model.n_layer={run.layers}",
        f"model.n_head={run.heads}",
        f"model.d_model={run.hidden}",
        f"model.vocab_size={run.vocab}",
        f"model.max_seq_len={run.seq}",
        "model.dropout=0.1",
        f"train.seq_len={run.seq}",
        f"train.micro_batch_size={run.micro_batch}",
        f"train.global_batch_size={run.batch}",
        "train.precision=bf16",
        f"train.activation_checkpointing={run.recompute}",
        f"parallel.tp={run.tp}",
        f"parallel.pp={run.pp}",
        f"parallel.pp_virtual={run.virtual}",
        f"parallel.dp={run.dp}",
        f"parallel.sequence_parallel={str(run.sequence_parallel).lower()}",
        f"parallel.tp_comm_overlap={str(run.tp_overlap and run.tp > 1).lower()}",
        f"optim.zero={run.zero}",
        f"optim.overlap_grad_reduce={str(run.overlap_dp).lower()}",
    ]
    if run.gpu == "H100":
        sets.append("optim.grad_reduce_dtype=bf16")  # Megatron-LM reduces bf16 gradients
    cfg = load_config(None, sets)
    return cfg, derive(cfg, run.gpus)


def narayanan_flops(run: PublishedRun) -> float:
    """Eq. (3) of Narayanan et al. 2021: hardware FLOPs per iteration."""
    B, s, l, h, V = run.batch, run.seq, run.layers, run.hidden, run.vocab  # noqa: E741
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def predict(run: PublishedRun) -> StepTime:
    cfg, d = config_of(run)
    return step_time(cfg, d, GPUS[run.gpu], attention=run.attention, cluster=CLUSTERS[run.cluster])


def published_step_s(run: PublishedRun) -> float:
    """The step time a row publishes or implies: its iteration time, or its model FLOPs over its
    model TFLOP/s (or MFU of the dense bf16 peak) on all its GPUs."""
    if run.iteration_s is not None:
        return run.iteration_s
    predicted = predict(run)
    rate = run.tflops_per_gpu * 1e12 if run.tflops_per_gpu else run.mfu * predicted.peak_flops
    return predicted.model_flops / (rate * run.gpus)


def compare(run: PublishedRun) -> tuple[str, float, float]:
    """(what is compared, published, predicted) for a run: hardware TFLOP/s per GPU by eq. (3)
    (Narayanan), model TFLOP/s per GPU (Megatron-LM's weak scaling) or MFU in %."""
    predicted = predict(run)
    if run.source == NARAYANAN:
        tflops = narayanan_flops(run) / predicted.step_time_s / run.gpus / 1e12
        return "hardware TFLOP/s per GPU", run.tflops_per_gpu, tflops
    if run.tflops_per_gpu is not None:
        return "model TFLOP/s per GPU", run.tflops_per_gpu, predicted.model_tflops_per_gpu
    return "MFU %", 100 * run.mfu, 100 * predicted.mfu
