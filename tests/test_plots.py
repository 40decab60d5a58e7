"""Shared figures: the theme, the roofline chart and the decode-bytes bars."""

from __future__ import annotations

import matplotlib

matplotlib.use("agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from workbench.hardware import get_hardware  # noqa: E402
from workbench.plots import figure_summary, plot_decode_bytes, plot_roofline, set_theme  # noqa: E402
from workbench.roofline import get_model  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures() -> None:
    yield
    plt.close("all")


def test_set_theme_sets_one_look() -> None:
    set_theme()
    assert matplotlib.rcParams["savefig.bbox"] == "tight"
    assert matplotlib.rcParams["axes.grid"]


def test_roofline_chart_has_ceilings_and_one_point_per_op_and_phase() -> None:
    set_theme()
    hw = get_hardware("h100-sxm")
    model = get_model("Llama-3.1-8B", hw, dtype="bf16")
    phases = {"prefill": model.prefill([512] * 4), "decode": model.decode([1024] * 4)}
    ax = plot_roofline(hw, phases, dtype="bf16", ceiling_dtypes=["bf16", "fp8"], measured=[("run", 5.0, 2e13)])
    info = figure_summary(ax)
    assert info["xscale"] == "log" and info["yscale"] == "log"
    assert "FLOP/byte" in info["xlabel"] and "FLOP/s" in info["ylabel"]
    assert "H100" in info["title"]
    # ops with FLOPs: everything except the embedding gather and the KV write
    n_ops = sum(1 for cost in phases.values() for op in cost.ops if op.flops > 0)
    points = sum(len(c.get_offsets()) for c in ax.collections)
    assert points == n_ops + len(phases) + 1  # per op, per phase, one measured point
    # the roof bends at the bf16 peak; the fp8 and vector (fp32) ceilings are flat lines at their peaks
    roof = ax.lines[0].get_ydata()
    assert max(roof) == pytest.approx(989.5e12)
    flat = {round(line.get_ydata()[0]) for line in ax.lines if len(set(line.get_ydata())) == 1}
    assert {1979e12, 67e12} <= flat


def test_decode_bytes_bars_stack_weights_kv_and_activations() -> None:
    model = get_model("Llama-2-7B", "h100-sxm", dtype="fp16")
    costs = {f"B={b}, L=2048": model.decode([2048] * b) for b in (1, 8, 32)}
    ax = plot_decode_bytes(costs)
    assert "GB" in figure_summary(ax)["ylabel"]
    # three kinds x three bars; each bar's stack sums to the step's bytes
    assert len(ax.patches) == 9
    for i, cost in enumerate(costs.values()):
        stack = [p.get_height() for p in ax.patches[i::3]]
        assert sum(stack) == pytest.approx(cost.bytes / 1e9)
    # at batch 32 the KV (32 x 2048 x 512 KiB = 34 GB) outweighs the weights (13 GB)
    assert ax.patches[3 + 2].get_height() > ax.patches[0 + 2].get_height()


def test_trials_chart_draws_every_round_the_interval_and_the_margin() -> None:
    from workbench import plots
    from workbench.experiments.trials import DecisionRule, run_rounds

    a, b = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95], [2.0, 2.3, 1.8, 2.0, 2.1, 1.9]
    cmp = run_rounds({"batch 1": lambda i: a[i], "batch 8": lambda i: b[i]}, DecisionRule("higher"), warmup=0,
                     min_rounds=6, max_rounds=6, control=lambda i: a[5 - i])  # fmt: skip
    ax = plots.plot_trials({"batching": cmp, "again": cmp})
    assert plots.figure_summary(ax)["xscale"] == "log" and "B/A" in ax.get_xlabel()
    points = [c.get_offsets() for c in ax.collections if len(c.get_offsets()) == 6]
    assert len(points) == 4  # per comparison: six B/A ratios and six A/A ratios
    assert sorted(round(x, 6) for x in points[0][:, 0]) == sorted(round(y / x, 6) for x, y in zip(a, b))
    assert [t.get_text().split("\n")[1] for t in ax.get_yticklabels()] == ["batch 8 / batch 1"] * 2
