"""The step-time model against published large runs: prints docs/planning.md's table (published,
predicted, error per row) from tests/published_runs.py, which holds the rows and their sources
(Narayanan et al. 2021, Table 1: hardware TFLOP/s per GPU by the paper's eq. (3); Korthikanti
et al. 2022, Tables 3 and 5: iteration time and MFU).

    python scripts/plan_validation.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.published_runs import RUNS, compare, predict  # noqa: E402


def main() -> None:
    print("| source | model | layout (tp, pp, v, dp) | compared | published | predicted | error |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: |")
    errors = []
    for run in RUNS:
        what, published, predicted = compare(run)
        error = (predicted - published) / published
        errors.append(abs(error))
        layout = f"{run.tp}, {run.pp}, {run.virtual}, {run.gpus // (run.tp * run.pp)}"
        print(f"| {run.source} | {run.name} | {layout} | {what} | {published:.1f} | "
              f"{predicted:.1f} | {100 * error:+.1f}% |")  # fmt: skip
        if run.iteration_s is not None:
            step, want = predict(run).step_time_s, run.iteration_s
            print(f"| {run.source} | {run.name} | {layout} | iteration s | {want:.2f} "
                  f"| {step:.2f} | {100 * (step - want) / want:+.1f}% |")  # fmt: skip
    print()
    print(f"Largest error {100 * max(errors):.1f}%, median {100 * statistics.median(errors):.1f}% "
          f"(TFLOP/s and MFU rows, {len(errors)} runs).")  # fmt: skip


if __name__ == "__main__":
    main()
