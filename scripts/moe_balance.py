"""Auxiliary-loss-free balancing at work: the tiny MoE config (configs/tiny-moe.yaml) with
DeepSeek-V3's sigmoid router and no balancing loss, trained on CPU in one process with
model.moe.bias_update_speed 0 (off) and on, printing each logged step's expert-load spread
(metrics.jsonl's moe_load_spread: the busiest expert's tokens over the mean, worst layer;
1 is perfect balance) and the routing biases' range.

    python scripts/moe_balance.py [--steps 60] [--speed 0.01] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "tiny-moe.yaml"
SIGMOID = [
    "model.moe.router=sigmoid",
    "model.moe.aux_loss_coef=0",
    "model.moe.z_loss_coef=0",
    "train.eval_every=0",
    "checkpoint.save=false",
]


def run(speed: float, steps: int, every: int, out: Path) -> list[dict]:
    """The training lines of metrics.jsonl of one run."""
    sets = [*SIGMOID, f"model.moe.bias_update_speed={speed}", f"train.steps={steps}"]
    sets += [f"train.log_every={every}", f"run.out_dir={out}"]
    args = [sys.executable, "-m", "megatronish", "train", "--config", str(CONFIG)]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "moe_load_spread" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--speed", type=float, default=0.01)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        off = run(0.0, args.steps, args.every, Path(tmp) / "off")
        on = run(args.speed, args.steps, args.every, Path(tmp) / "on")
    print(f"step  spread(off)  spread(speed {args.speed})  bias range  loss(off)  loss(on)")
    for a, b in zip(off, on):
        print(
            f"{a['step']:4d}  {a['moe_load_spread']:11.3f}  {b['moe_load_spread']:17.3f}  "
            f"{b['moe_bias_range']:10.3f}  {a['loss']:9.4f}  {b['loss']:8.4f}"
        )


if __name__ == "__main__":
    main()
