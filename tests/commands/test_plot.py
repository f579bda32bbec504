"""`plot` turns a run's metrics.jsonl into a PNG; a directory without metrics is exit 2."""

from __future__ import annotations

import json

from tests.conftest import invoke_cli


def test_plot_writes_a_png_of_the_curves(tmp_path):
    lines = [
        {"step": s, "loss": 5 - s / 10, "lr": 1e-3, "tokens_per_s": 1000.0} for s in range(1, 6)
    ]
    lines.append({"step": 5, "val_loss": 4.6})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = invoke_cli("plot", str(tmp_path), "--output", str(tmp_path / "c.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_directory_without_metrics_exits_2(tmp_path):
    result = invoke_cli("plot", str(tmp_path))
    assert result.returncode == 2 and "metrics.jsonl does not exist" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plot_adds_phase_time_and_memory_panels_when_the_run_recorded_them(tmp_path):
    from PIL import Image

    from megatronish.observe.phases import FIELDS

    def stats(value):
        return {"min": value, "median": value, "max": 2 * value, "max_rank": 1}

    phases = {(n if n.startswith("peak") else f"{n}_s"): stats(0.1) for n in FIELDS}
    lines = [
        {"step": s, "loss": 5 - s / 10, "lr": 1e-3, "tokens_per_s": 1000.0, "phases": phases}
        for s in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = invoke_cli("plot", str(tmp_path), "--output", str(tmp_path / "c.png"))
    assert result.returncode == 0, result.stderr
    assert Image.open(tmp_path / "c.png").size[1] == 1500  # five panels of 3 inches at 100 dpi


def test_plot_axes_of_absolute_quantities_start_at_zero_and_the_loss_axis_spans_the_loss():
    import matplotlib.pyplot as plt

    from megatronish.commands.plot import draw_curves
    from megatronish.observe.phases import FIELDS

    def stats(value):
        return {"min": value, "median": value, "max": value, "max_rank": 0}

    def phases(step):
        found = {f"{n}_s": stats(0.10 + step / 1000) for n in FIELDS if not n.startswith("peak")}
        return dict(found, peak_memory=stats((0.320 + step / 1000) * 2**30))  # a flat line

    lines = [
        {"step": s, "loss": 5 - s / 10, "lr": 1e-3, "tokens_per_s": 9000.0 + s,
         "phases": phases(s)}
        for s in range(1, 8)
    ]  # fmt: skip
    fig = draw_curves(lines, [], "run")
    try:
        loss, *absolute = fig.axes
        assert loss.get_ylim()[0] > 4
        assert [ax.get_ylim()[0] for ax in absolute] == [0.0] * 4
        assert absolute[-1].get_ylabel() == "peak memory GiB"
    finally:
        plt.close(fig)
