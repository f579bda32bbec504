"""Our fp8 training curve against torchao's: a tiny random transformers Llama trained 20 steps by
us (checkpoint.init_from_hf, train.precision fp8, fp32 as the high precision) and, on the same
batches under our schedule with torch.optim.AdamW, converted by torchao's
convert_to_float8_training (emulated) and unconverted in fp32 (tests/fp8/torchao_curve.py).
Prints per step our loss's distance to the fp8 reference over the fp8 reference's distance to
the fp32 one (the criterion: below 0.1 at every step), for each learning rate, with the
reference's q, k and v projections separate (transformers' own) or fused as ours are.

    python scripts/fp8_torchao_curve.py [--recipe rowwise] [--lr 3e-3 1e-3 3e-4]
        [--reference separate fused] [--attention eager sdpa]
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
    parser.add_argument("--set", nargs="*", default=[], help="more settings of our run")
    parser.add_argument("--verbose", action="store_true", help="every step's losses")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dataset = prepare_code_dataset(root)
        hf_dir = save_tiny_llama(root, dataset)
        print("recipe      lr  reference  attention  max ratio (step)  steps < 0.1  "
              "max |ours - fp8|  max |fp8 - fp32|")  # fmt: skip
        for lr in args.lr:
            for reference in args.reference:
                for attention in args.attention:
                    sets = [f"train.lr={lr}", f"train.steps={args.steps}", *args.set]
                    result = curves(
                        hf_dir, dataset, args.recipe, sets, reference == "fused", attention
                    )
                    r = ratios(result)
                    worst = max(range(len(r)), key=r.__getitem__)
                    ours = max(abs(o - f) for o, f in zip(result["ours"], result["fp8"]))
                    own = max(abs(o - f) for o, f in zip(result["fp8"], result["fp32"]))
                    below = sum(x < 0.1 for x in r)
                    row = f"{args.recipe:10} {lr:>6}  {reference:9}  {attention:9}  "
                    row += f"{r[worst]:10.3g} ({worst + 1:2d})  {below:5d}/{len(r)}  "
                    print(row + f"{ours:16.3e}  {own:16.3e}", flush=True)
                    if args.verbose:
                        for step, row in enumerate(zip(*result.values(), r), 1):
                            print(
                                "   ", step, " ".join(f"{v:.7f}" for v in row[:3]), f"{row[3]:.3g}"
                            )


if __name__ == "__main__":
    main()
