"""Our fp8 training curve against torchao's: a tiny random transformers Llama trained 20 steps by
us (checkpoint.init_from_hf, train.precision fp8, fp32 as the high precision) and, on the same
batches under our schedule with torch.optim.AdamW, converted by torchao's
convert_to_float8_training (emulated) and unconverted in fp32 (tests/fp8/torchao_curve.py).
The ratio of our loss's distance to the fp8 reference over the fp8 reference's distance to the
fp32 one (the criterion: below 0.1 at every step): one line per learning rate, reference and
attention with its largest value over the steps (--verbose: every step's), the reference's q, k
and v projections separate (transformers' own) or fused in one torchao layer (in our row order),
the model's k_proj weights --key-scale times the random init's (tests/fp8/test_fp8_curve.py: 64).

    python scripts/fp8_torchao_curve.py [--recipe rowwise] [--lr 3e-3 1e-3 3e-4]
        [--reference separate fused] [--attention eager sdpa] [--key-scale 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fp8.torchao_curve import curves, ratios, save_tiny_llama  # noqa: E402
from tests.parity import prepare_code_dataset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="rowwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--lr", nargs="+", default=["3e-3", "1e-3", "3e-4"])
    parser.add_argument("--reference", nargs="+", default=["separate", "fused"])
    parser.add_argument("--attention", nargs="+", default=["eager"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--key-scale", type=float, default=1.0, help="k_proj's weights times")
    parser.add_argument("--set", nargs="*", default=[], help="more settings of our run")
    parser.add_argument("--verbose", action="store_true", help="every step's losses")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dataset = prepare_code_dataset(root)
        hf_dir = save_tiny_llama(root, dataset, key_scale=args.key_scale)
        print("recipe        lr  reference  attention  max ratio (step)  steps < 0.1  "
              "max |ours - fp8|  max |fp8 - fp32|")  # fmt: skip
        for lr in args.lr:
            for reference in args.reference:
                fused = reference == "fused"
                references = {}
                for attention in args.attention:
                    references[f"fp8 {attention}"] = (fused, attention)
                    references[f"fp32 {attention}"] = (None, attention)
                sets = [f"train.lr={lr}", f"train.steps={args.steps}", *args.set]
                result = curves(hf_dir, dataset, args.recipe, sets, references)
                for attention in args.attention:
                    fp8, fp32 = f"fp8 {attention}", f"fp32 {attention}"
                    head = f"{args.recipe:10} {lr:>6}  {reference:9}  {attention:9}  "
                    report(head, result, "ours", fp8, fp32, args.verbose)
                if len(args.attention) == 2:  # torchao against itself: one attention or the other
                    one, other = args.attention
                    head = f"{'torchao':10} {lr:>6}  {reference:9}  {one} vs {other}  "
                    report(head, result, f"fp8 {one}", f"fp8 {other}", f"fp32 {other}", False)


def report(head: str, result: dict, of: str, fp8: str, fp32: str, verbose: bool) -> None:
    """One line: the largest ratio (ratios) and its step, the steps below 0.1, the largest
    distance of `of` to the fp8 reference and of that to the fp32 one; with verbose, each
    step's three losses and ratio."""
    r = ratios(result, of, fp8, fp32)
    worst = max(range(len(r)), key=r.__getitem__)
    ours = max(abs(o - f) for o, f in zip(result[of], result[fp8]))
    own = max(abs(o - f) for o, f in zip(result[fp8], result[fp32]))
    below = sum(x < 0.1 for x in r)
    row = head + f"{r[worst]:10.3g} ({worst + 1:2d})  {below:5d}/{len(r)}  "
    print(row + f"{ours:16.3e}  {own:16.3e}", flush=True)
    if verbose:
        for step, losses in enumerate(zip(result[of], result[fp8], result[fp32], r), 1):
            print("   ", step, " ".join(f"{v:.7f}" for v in losses[:3]), f"{losses[3]:.3g}")


if __name__ == "__main__":
    main()
