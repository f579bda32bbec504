"""The parity harness of the training tests (pipeline, interleaved pipeline, context, MoE, ZeRO,
gradient overlap, phases, traces): what they train and how they compare it.

- the model: SMALL (4 layers, d_model 32, STEPS = 10 fp32 steps of 8 sequences of 16 tokens) and the
  override lists GPT2, LLAMA (GQA), SP (sequence parallelism), OVERLAP (tensor-parallel
  communication decomposed under the GEMMs) and MTP, MTP2 (multi-token prediction);
- the data: `prepare_code_dataset`, ten documents of small Python functions (the `dataset`
  fixture of tests/conftest.py is one, prepared once per session);
- the runs: `make_config` (SMALL at a layout), `make_trainer` (a Trainer on the groups a launched
  run builds), `train_losses`, `train_counted` (losses, grad norms and the first step's
  collectives), and `reference`, the cached one-process run of a set of overrides;
- the comparisons: `assert_close` (curves within 1e-5 relative), `assert_curves_match` (every
  rank's curves equal the reference's, or its first LAYOUT_STEPS, the multi-token prediction
  loss's too),
  `assert_overlap_matches` (a variant with OVERLAP equals the one without to 1e-6) and
  `assert_check_fails_with_one_line` (a bad setting is one line from `megatronish check`).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatronish.config import derive, load_config
from megatronish.data import prepare_dataset
from tests.conftest import invoke_cli
from tests.tolerances import LAYOUT_CURVE_REL, OVERLAP_REL

STEPS = 10
SAVE_AT = 5  # the resumable runs save here and resume on the curve's second half
# A layout's run against its reference: the reference's first steps (warmup's 2 and 3 after
# them), where a layout that splits, reduces or schedules anything wrongly already parts from it.
LAYOUT_STEPS = 5
SMALL = [
    "model.n_layer=4",
    "model.d_model=32",
    "model.n_head=4",
    "model.max_seq_len=16",
    "train.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    f"train.steps={STEPS}",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "train.eval_every=0",
    "checkpoint.save=false",
]
GPT2 = ["model.arch=gpt2"]
LLAMA = ["model.arch=llama", "model.n_kv_head=2"]
SP = ["parallel.sequence_parallel=true"]
OVERLAP = ["parallel.tp_comm_overlap=true"]
MTP = ["model.mtp_depth=1"]  # multi-token prediction, DeepSeek-V3's depth
MTP2 = ["model.mtp_depth=2"]

# One function of the parity dataset, of its index i and its document's index part.
CODE_FUNCTION = "def g{i}(x):\n    return x - {i} * {part}\n\n"


def prepare_code_dataset(root: Path, function: str = CODE_FUNCTION) -> Path:
    """A byte-level dataset in root/ds of ten documents (so that the validation split, a tenth,
    gets one) of 80 functions each, written from the `function` template (fields i and part)."""
    files = []
    for part in range(10):
        text = "".join(function.format(i=i, part=part) for i in range(80))
        (root / f"part{part}.py").write_text(text)
        files.append(str(root / f"part{part}.py"))
    return prepare_dataset(files, str(root / "ds"), val_fraction=0.1)


def prepare_short_documents(root: Path) -> Path:
    """A byte-level dataset in root/ds of 400 documents of 3 to 13 bytes, none for validation:
    a 16-token sample holds two or three of them, so document masks change every step's loss
    (prepare_code_dataset's documents are longer than a whole run reads)."""
    lines = [json.dumps({"text": "x" * (i % 7) + f"={i}\n"}) for i in range(400)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return prepare_dataset([str(root / "docs.jsonl")], str(root / "ds"), val_fraction=0.0)


def make_config(
    tp: int,
    dp: int,
    pp: int,
    overrides: list[str],
    dataset: Path,
    extra=(),
    *,
    cp: int | None = None,
    ep: int | None = None,
):
    """SMALL with overrides at this layout (cp and ep set only when given), on dataset, with
    extra settings last."""
    layout = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep}
    sets = SMALL + overrides + [f"parallel.{k}={v}" for k, v in layout.items() if v is not None]
    return load_config(None, sets + [f"data.path={dataset}", *extra])


def make_trainer(cfg, world: int, dataset: Path, ps=None):
    """A Trainer on the ranks' groups as a launched run builds them (tp and dp through shared
    memory; the previous trainer's shared buffers released)."""
    from megatronish.data.sources import run_data
    from megatronish.distributed import comm
    from megatronish.distributed.layout import ParallelState, use_shared_memory
    from megatronish.training.setup import Setup
    from megatronish.training.trainer import Trainer

    assert cfg.data.path == str(dataset), "make_config puts the dataset in data.path"
    cfg, data = run_data(cfg)  # as setup() opens it (SFT data: document masks)
    derived = derive(cfg, world, vocab_size=data.vocab_size)
    if ps is None:
        comm.disable_shared_memory()
        ps = ParallelState.from_world(derived.tp, derived.dp, derived.pp, derived.cp, derived.ep)
        ps = use_shared_memory(ps, 120)
    return Trainer(Setup(cfg, derived, ps, data))


def train_losses(trainer) -> list[float]:
    """The losses of training on to the configured train.steps."""
    return [trainer.train_step().loss for _ in range(trainer.cfg.train.steps - trainer.step)]


def train_counted(
    trainer, steps: int, save_every: int = 0, mtp_losses: list | None = None, logits=None
):
    """(losses, grad norms, CommCounter of the first step) of training to `steps`, saving a
    checkpoint every `save_every` steps (0: never); each step's multi-token prediction loss
    appended to mtp_losses when given, and its max_attn_logit (QK-clip's) to logits."""
    from megatronish.distributed import comm

    losses, norms = [], []

    def record(step) -> None:
        losses.append(step.loss)
        norms.append(step.grad_norm)
        if mtp_losses is not None:
            mtp_losses.append(step.mtp_loss)
        if logits is not None:
            logits.append(trainer.qk_clip.metrics().get("max_attn_logit"))

    with comm.CommCounter() as counter:
        record(trainer.train_step())
    while trainer.step < steps:
        record(trainer.train_step())
        if save_every and trainer.step % save_every == 0:
            trainer.save_checkpoint()
    return losses, norms, counter


_REFERENCES: dict = {}


def reference(overrides: list[str], dataset: Path) -> dict:
    """The pp = 1 run of these settings in this process (once per settings and dataset): its
    losses, grad norms and trainer (at step STEPS). Optimizer settings are left out: at one
    rank ZeRO changes nothing."""
    key = (tuple(o for o in overrides if not o.startswith("optim.")), dataset)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_reference(list(key[0]), dataset)
    return _REFERENCES[key]


def run_reference(overrides: list[str], dataset: Path, steps: int = STEPS, **sets) -> dict:
    """A fresh one-process run of `steps` steps (not cached), with `sets` as extra settings."""
    from megatronish.distributed.layout import ParallelState

    cfg = make_config(1, 1, 1, overrides, dataset, [f"{k}={v}" for k, v in sets.items()])
    trainer = make_trainer(cfg, 1, dataset, ParallelState.single())
    mtp, logits = [], []
    losses, norms, _ = train_counted(trainer, steps, mtp_losses=mtp, logits=logits)
    return {
        "losses": losses,
        "norms": norms,
        "mtp_losses": mtp,
        "max_attn_logits": logits,
        "trainer": trainer,
    }


def assert_close(
    actual: list[float], expected: list[float], rel: float = LAYOUT_CURVE_REL, steps: int = STEPS
) -> None:
    """Both curves are `steps` long and equal step by step within rel (relative)."""
    assert len(actual) == len(expected) == steps
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rel * abs(e), f"step {step}: {a} vs {e}"


def assert_curves_match(per_rank: list[dict], name: str, ref: dict, steps: int = STEPS) -> None:
    """Every rank's losses and grad norms of variant `name` equal the reference's first `steps`,
    and so do its multi-token prediction losses when the variant has them."""
    for rank_results in per_rank:
        assert_close(rank_results[name]["losses"], ref["losses"][:steps], steps=steps)
        assert_close(rank_results[name]["norms"], ref["norms"][:steps], steps=steps)
        assert_mtp_close(rank_results[name], ref, steps)


def assert_mtp_close(result: dict, ref: dict, steps: int = STEPS) -> None:
    """result's multi-token prediction losses (the "mtp_losses" recorded with train_counted)
    equal ref's first `steps` within 1e-5 relative, when its settings have model.mtp_depth
    (else both are None)."""
    mtp, want = result.get("mtp_losses"), ref.get("mtp_losses")
    if mtp is None or want is None or want[0] is None:
        assert mtp is None or all(m is None for m in mtp), "mtp losses without a reference"
        return
    assert_close(mtp, want[:steps], steps=steps)


def assert_overlap_matches(per_rank: list[dict], name: str, steps: int = STEPS) -> None:
    """Every rank's losses and grad norms of variant `name + " overlap"` (OVERLAP) equal those
    of `name` within OVERLAP_REL, over their `steps` steps."""
    for rank_results in per_rank:
        for key in ("losses", "norms"):
            want = rank_results[name][key]
            assert_close(rank_results[f"{name} overlap"][key], want, rel=OVERLAP_REL, steps=steps)


def assert_check_fails_with_one_line(args: list[str], key: str) -> None:
    """`megatronish check ARGS` exits 2 with one stderr line that names key, no traceback."""
    result = invoke_cli("check", *args)
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], result.stderr
    assert "Traceback" not in result.stderr
