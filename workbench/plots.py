"""The workbench's shared figures: one theme, and the plotting functions notebooks call.

Call ``set_theme()`` once (notebooks do it in their first cell); every figure function takes an optional
``ax`` and returns the ``Axes`` it drew on, with axes labelled in units and a title. matplotlib (and
seaborn, when installed) are imported inside the functions, so importing the analytical modules
(``workbench.roofline`` ...) never imports them.

Figures here: ``plot_roofline`` (log-log roofline with the hardware's ceilings and one point per operation
and phase) and ``plot_decode_bytes`` (stacked bars of where a decode step's bytes go).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes

    from workbench.hardware import HardwareSpec
    from workbench.roofline import StepCost

PALETTE = "colorblind"
# fixed colours per byte kind and per phase, so every figure of a report agrees
BYTE_KIND_COLORS = {"weights": "#0173B2", "kv": "#DE8F05", "activations": "#029E73"}
PHASE_MARKERS = {"prefill": "o", "decode": "s"}


def set_theme(context: str = "notebook") -> None:
    """The one theme of every workbench figure: seaborn 'whitegrid', colour-blind palette, readable sizes."""
    import matplotlib as mpl

    try:
        import seaborn as sns

        sns.set_theme(context=context, style="whitegrid", palette=PALETTE)
    except ImportError:  # the GPU box may lack seaborn; keep the same look with matplotlib alone
        mpl.style.use("seaborn-v0_8-whitegrid")
    mpl.rcParams.update(
        {
            "figure.figsize": (7.5, 4.8),
            "figure.dpi": 100,
            "savefig.dpi": 150,
            "savefig.bbox": "tight",
            "axes.titlesize": "medium",
            "axes.titleweight": "bold",
            "legend.fontsize": "small",
            "legend.frameon": True,
        }
    )


def _new_ax(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    return ax


def _tflops(flops: float) -> str:
    tf = flops / 1e12
    return f"{tf:,.0f} TFLOP/s" if tf >= 10 else f"{tf:.3g} TFLOP/s"


def _group_points(
    points: Sequence[tuple[str, float, float]], tol: float = 0.15
) -> list[tuple[list[str], float, float]]:
    """Merge points closer than ``tol`` (in log10 units on both axes) so their labels do not overprint."""
    import math

    groups: list[tuple[list[str], float, float]] = []
    for name, x, y in sorted(points, key=lambda p: (p[1], p[2])):
        for names, gx, gy in groups:
            if abs(math.log10(x / gx)) < tol and abs(math.log10(y / gy)) < tol:
                names.append(name)
                break
        else:
            groups.append(([name], x, y))
    return groups


def _wrap(names: list[str], per_line: int = 3) -> str:
    return "\n".join(", ".join(names[i : i + per_line]) for i in range(0, len(names), per_line))


def plot_roofline(
    hw: HardwareSpec,
    phases: Mapping[str, StepCost] | None = None,
    dtype: str = "bf16",
    ceiling_dtypes: Sequence[str] | None = None,
    measured: Sequence[tuple[str, float, float]] = (),
    label_ops: bool = True,
    ax: Axes | None = None,
) -> Axes:
    """Log-log roofline of ``hw``: attainable FLOP/s against arithmetic intensity (FLOP/byte).

    Ceilings: the memory roof ``bandwidth * intensity`` and a flat compute roof per dtype in
    ``ceiling_dtypes`` (default: ``dtype``). ``phases`` maps a phase name ('prefill', 'decode', ...) to a
    detailed ``StepCost``: each operation is one small point at (its intensity, its FLOPs / predicted time),
    labelled, and the whole phase one large point. Operations without FLOPs (the embedding gather, the KV
    write) have no place on a log axis and are left out. ``measured`` adds points
    ``(label, intensity, achieved FLOP/s)`` from measured runs.
    """
    ax = _new_ax(ax)
    phases = dict(phases or {})
    ceiling_dtypes = list(ceiling_dtypes or [dtype])
    intensities = [1e-2, 1e4]
    for cost in phases.values():
        for op in cost.ops or ():
            if op.flops > 0 and op.bytes > 0:
                intensities.append(op.intensity)
    for _, inten, _ in measured:
        intensities.append(inten)
    lo, hi = min(intensities) / 3, max(intensities) * 3
    peak = hw.peak(dtype)
    top_peak = max(hw.peak(d) for d in [*ceiling_dtypes, dtype])
    bw = hw.mem_bandwidth
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(bw * x, peak) for x in xs], color="black", lw=2, label=f"roof ({dtype} matmul)")
    for d in dict.fromkeys([*ceiling_dtypes, dtype]):
        p = hw.peak(d)
        if d != dtype:
            ax.plot([p / bw, hi], [p, p], color="grey", ls="--", lw=1)
        ax.text(hi, p, f"{d} {_tflops(p)} ", va="bottom", ha="right", fontsize="small")
        ax.axvline(p / bw, color="grey", ls=":", lw=0.8)
    vec = hw.vector_flops
    if vec < peak:
        ax.plot([vec / bw, hi], [vec, vec], color="grey", ls="-.", lw=1)
        ax.text(hi, vec, f"vector (fp32) {_tflops(vec)} ", va="bottom", ha="right", fontsize="small")
    ax.text(lo * 1.2, bw * lo * 1.5, f"{bw / 1e12:.3g} TB/s", fontsize="small", color="black")
    colors = ["C0", "C1", "C2", "C3", "C4", "C5"]
    for i, (phase, cost) in enumerate(phases.items()):
        color = colors[i % len(colors)]
        marker = PHASE_MARKERS.get(phase, "D")
        pts = [(op.name, op.intensity, op.flops / op.time_s) for op in cost.ops or () if op.flops > 0 and op.bytes > 0]
        if pts:
            ax.scatter([p[1] for p in pts], [p[2] for p in pts], s=18, color=color, marker=marker, alpha=0.7)
            if label_ops:
                for names, x, y in _group_points(pts):
                    ax.annotate(
                        _wrap(names), (x, y), xytext=(4, -4), textcoords="offset points", fontsize=6,
                        color=color, va="top",
                    )  # fmt: skip
        if cost.time_s > 0 and cost.flops > 0:
            ax.scatter(
                [cost.intensity],
                [cost.flops / cost.time_s],
                s=90,
                color=color,
                marker=marker,
                edgecolor="black",
                label=f"{phase} (whole step)",
                zorder=5,
            )
    for label, inten, achieved in measured:
        ax.scatter([inten], [achieved], s=70, marker="*", color="crimson", zorder=6)
        ax.annotate(label, (inten, achieved), xytext=(4, 4), textcoords="offset points", fontsize=7, color="crimson")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(bw * lo, top_peak) / 3, top_peak * 3)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable performance (FLOP/s)")
    ax.set_title(f"Roofline: {hw.display_name or hw.name} (balance {hw.peak(dtype) / bw:.0f} FLOP/byte, {dtype})")
    ax.legend(loc="lower right")
    return ax


def plot_decode_bytes(
    costs: Mapping[str, StepCost],
    unit: float = 1e9,
    unit_name: str = "GB",
    ax: Axes | None = None,
    title: str = "Where a decode step's bytes go",
) -> Axes:
    """Stacked bars of a decode step's bytes by kind (weights, KV cache, activations), one bar per entry of
    ``costs`` (label -> ``StepCost``, e.g. one per batch size or context length)."""
    ax = _new_ax(ax)
    labels = list(costs)
    bottoms = [0.0] * len(labels)
    for kind, color in BYTE_KIND_COLORS.items():
        heights = [costs[label].bytes_by_kind()[kind] / unit for label in labels]
        ax.bar(labels, heights, bottom=bottoms, color=color, label=kind, edgecolor="white", width=0.7)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel(f"bytes moved per decode step ({unit_name})")
    ax.set_xlabel("configuration")
    ax.set_title(title)
    ax.legend(title="bytes", loc="upper left")
    if len(labels) > 6:
        ax.tick_params(axis="x", labelrotation=45)
    return ax


def figure_summary(ax: Axes) -> dict[str, Any]:
    """Title, axis labels and scales of an Axes: what tests and reports check about a figure."""
    return {
        "title": ax.get_title(),
        "xlabel": ax.get_xlabel(),
        "ylabel": ax.get_ylabel(),
        "xscale": ax.get_xscale(),
        "yscale": ax.get_yscale(),
    }


__all__ = ["set_theme", "plot_roofline", "plot_decode_bytes", "figure_summary", "BYTE_KIND_COLORS"]
