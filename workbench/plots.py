"""The workbench's shared figures: one theme, and the plotting functions notebooks call.

Call ``set_theme()`` once (notebooks do it in their first cell); every figure function takes an optional
``ax`` and returns the ``Axes`` it drew on, with axes labelled in units and a title. matplotlib (and
seaborn, when installed) are imported inside the functions, so importing the analytical modules
(``workbench.roofline`` ...) never imports them.

Figures here: ``plot_roofline`` (log-log roofline with the hardware's ceilings and one point per operation
and phase), ``plot_decode_bytes`` (stacked bars of where a decode step's bytes go), and the experiments' figures:
``plot_phase_times`` (01), ``plot_variant_decode`` and ``plot_waste`` (02), ``plot_batch_sweep`` and
``plot_policy_bars`` (03), ``plot_step_timelines`` and ``plot_budget_tradeoff`` (04), ``plot_decode_levers``,
``plot_accuracy_speed`` and ``plot_phase_speedups`` (08), ``plot_speculative_speedup`` (09), and
``plot_trials`` (the paired rounds behind every
timing claim: each round's B/A and A/A ratio, the interval and the margin). Every timing is drawn with
error bars from its min..max over the repeats (rows with ``time_min_s`` / ``time_max_s``). Titles name the axes
and the setting, never a claim: the claims and their verdicts are in each notebook's conclusion.
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
    """FLOP/s in the unit that reads: TFLOP/s for an accelerator, GFLOP/s for a CPU."""
    tf = flops / 1e12
    if tf < 1:
        return f"{flops / 1e9:.3g} GFLOP/s"
    return f"{tf:,.0f} TFLOP/s" if tf >= 10 else f"{tf:.3g} TFLOP/s"


def _bandwidth(bytes_per_s: float) -> str:
    """Bytes/s in the unit that reads: TB/s, else GB/s."""
    return f"{bytes_per_s / 1e12:.3g} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.3g} GB/s"


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
    ax.text(lo * 1.2, bw * lo * 3, _bandwidth(bw), fontsize="small", color="black")
    colors = ["C0", "C1", "C2", "C3", "C4", "C5"]
    labelled: list[tuple[str, float, float]] = []  # every phase's operations, labelled once across phases
    for i, (phase, cost) in enumerate(phases.items()):
        color = colors[i % len(colors)]
        kind = next((k for k in PHASE_MARKERS if phase.startswith(k)), None)
        marker = PHASE_MARKERS.get(kind, "D") if kind else "D"
        pts = [(op.name, op.intensity, op.flops / op.time_s) for op in cost.ops or () if op.flops > 0 and op.bytes > 0]
        if pts:
            ax.scatter([p[1] for p in pts], [p[2] for p in pts], s=18, color=color, marker=marker, alpha=0.7)
            labelled += pts
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
    if label_ops:
        for names, x, y in _group_points(labelled, tol=0.3):
            unique = list(dict.fromkeys(names))
            ax.annotate(
                _wrap(unique), (x, y), xytext=(4, -4), textcoords="offset points", fontsize=6, color="#333", va="top"
            )
    for _label, inten, achieved in measured:
        ax.scatter([inten], [achieved], s=70, marker="*", color="crimson", zorder=6)
    for names, x, y in _group_points(measured, tol=0.15):  # neighbours share one label instead of overprinting
        ax.annotate(_wrap(names, 2), (x, y), xytext=(5, 3), textcoords="offset points", fontsize=7, color="crimson")
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


def _yerr(rows: Any, key: str = "time_s", scale: float = 1.0) -> Any:
    """Asymmetric error bars (below, above) from ``<key>_min_s`` / ``<key>_max_s`` columns, or None."""
    base = key.removesuffix("_s")
    lo, hi = f"{base}_min_s", f"{base}_max_s"
    if lo not in rows or hi not in rows:
        return None
    return [(rows[key] - rows[lo]).clip(lower=0) * scale, (rows[hi] - rows[key]).clip(lower=0) * scale]


def _log_ticks(ax: Axes, values: Sequence[float], axis: str = "x") -> None:
    """Tick marks at the measured values on a log axis (instead of two decades)."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(sorted(set(values))))
    target.set_minor_locator(NullLocator())
    target.set_major_formatter(ScalarFormatter())


def _log_y(ax: Axes) -> None:
    """A log y axis labelled at 1, 2 and 5 of each decade (instead of two bare decades)."""
    from matplotlib.ticker import LogLocator, NullLocator, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(NullLocator())
    formatter = ScalarFormatter()
    formatter.set_scientific(False)
    ax.yaxis.set_major_formatter(formatter)


def plot_phase_times(measured: Any, model_name: str, axes: Sequence[Axes] | None = None) -> Sequence[Axes]:
    """Two panels: TTFT against prompt length (prefill rows) and decode step time against batch size per context
    length (decode rows), measured (median, min..max bars) next to the roofline's prediction."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    p = measured[measured.phase == "prefill"]
    axes[0].errorbar(p.prompt_len, p.time_s * 1e3, yerr=_yerr(p, scale=1e3), fmt="o-", capsize=3, label="measured")
    axes[0].plot(p.prompt_len, p.predicted_s * 1e3, "s--", label="roofline (measured ceilings)")
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="prompt length (tokens)",
        ylabel="TTFT (ms)",
        title=f"Prefill time against prompt length ({model_name})",
    )
    _log_ticks(axes[0], p.prompt_len)
    _log_y(axes[0])
    axes[0].legend()
    d = measured[measured.phase == "decode"]
    for i, (kv, grp) in enumerate(d.groupby("context_len")):
        color = f"C{i}"
        axes[1].errorbar(
            grp.batch,
            grp.time_s * 1e3,
            yerr=_yerr(grp, scale=1e3),
            fmt="o-",
            capsize=3,
            color=color,
            label=f"measured, context {kv}",
        )
        axes[1].plot(grp.batch, grp.predicted_s * 1e3, "s--", alpha=0.6, color=color, label=f"roofline, context {kv}")
    axes[1].set(
        xscale="log",
        xlabel="batch size (sequences)",
        ylabel="decode step time (ms)",
        title=f"Decode step time against batch size ({model_name})",
    )
    _log_ticks(axes[1], d.batch)
    axes[1].legend(fontsize="small")
    return axes


def plot_variant_decode(decode: Any, batch: int, ax: Axes | None = None) -> Axes:
    """Decode step time against context length, one line per (KV variant, layout), with min..max bars."""
    ax = _new_ax(ax)
    for (kind, layout), grp in decode.groupby(["variant", "layout"], sort=False):
        style = "o-" if layout == "contiguous" else "x:"
        ax.errorbar(
            grp.context_len,
            grp.time_s * 1e3,
            yerr=_yerr(grp, scale=1e3),
            fmt=style,
            capsize=3,
            label=f"{kind}, {layout}",
        )
    ax.set(
        xscale="log",
        xlabel="context length (tokens per sequence)",
        ylabel="decode step time (ms)",
        title=f"Decode step time per KV variant, batch {batch}",
    )
    _log_ticks(ax, decode.context_len)
    ax.legend(title="KV heads, layout")
    return ax


def plot_waste(waste: Any, trace: str, ax: Axes | None = None) -> Axes:
    """Share of reserved KV memory holding no token: paged per block size, and the contiguous per-slot cache."""
    ax = _new_ax(ax)
    ax.plot(waste.block_size, waste["paged waste"] * 100, "o-", label="paged: tail of each last block")
    ax.axhline(waste["contiguous waste"].iloc[0] * 100, color="crimson", ls="--", label="contiguous per-slot cache")
    ax.set(
        xscale="log",
        xlabel="block size (tokens)",
        ylabel="reserved memory holding no token (%)",
        title=f"KV memory waste against block size ({trace} lengths)",
    )
    _log_ticks(ax, waste.block_size)
    ax.legend(title="KV layout")
    return ax


def plot_moe_decode_bytes(predicted: Any, measured: Any, model: str, measured_model: str,
                          axes: Sequence[Axes] | None = None) -> Sequence[Axes]:  # fmt: skip
    """Left: an MoE model's decode weight bytes and bytes per sequence against batch size (roofline, expected
    distinct experts). Right: distinct experts per step on this machine's model, counted from its routers,
    against E(1-(1-k/E)^B)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    axes[0].plot(predicted.batch, predicted.weight_bytes / 2**30, "o-", label="weights read per step")
    axes[0].plot(predicted.batch, predicted.bytes_per_seq / 2**30, "s--", label="per sequence")
    axes[0].set(xscale="log", yscale="log", xlabel="batch size (sequences)", ylabel="GiB",
                title=f"{model}: decode weight bytes (expected distinct experts)")  # fmt: skip
    _log_ticks(axes[0], predicted.batch)
    axes[0].legend()
    axes[1].plot(measured.batch, measured.measured_experts, "o-", label="counted from the routers")
    axes[1].plot(measured.batch, measured.expected_experts, "s--", label="E(1-(1-k/E)^B)")
    axes[1].set(xscale="log", xlabel="batch size (sequences)", ylabel="distinct experts per MoE layer",
                title=f"{measured_model}: experts one decode step reads")  # fmt: skip
    _log_ticks(axes[1], measured.batch)
    axes[1].legend()
    return axes


def plot_batch_sweep(sweep: Any, kv_len: int, axes: Sequence[Axes] | None = None) -> Sequence[Axes]:
    """Decode throughput (output tokens/s) and ITL against batch size, measured with min..max bars and the
    roofline's prediction."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    err = None
    if "tokens_per_s_min" in sweep:
        err = [sweep.tokens_per_s - sweep.tokens_per_s_min, sweep.tokens_per_s_max - sweep.tokens_per_s]
    axes[0].errorbar(sweep.batch, sweep.tokens_per_s, yerr=err, fmt="o-", capsize=3, label="measured")
    axes[0].plot(sweep.batch, sweep.batch / sweep.predicted_s, "s--", label="roofline (measured ceilings)")
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="batch size (sequences)",
        ylabel="decode throughput (output tokens/s)",
        title=f"Decode throughput against batch size, context {kv_len}",
    )
    _log_ticks(axes[0], sweep.batch)
    _log_y(axes[0])
    axes[0].legend()
    axes[1].errorbar(
        sweep.batch, sweep.time_s * 1e3, yerr=_yerr(sweep, scale=1e3), fmt="o-", capsize=3, label="measured (step time)"
    )
    axes[1].plot(sweep.batch, sweep.predicted_s * 1e3, "s--", label="roofline")
    axes[1].set(
        xscale="log",
        xlabel="batch size (sequences)",
        ylabel="inter-token latency (ms)",
        title=f"ITL against batch size, context {kv_len}",
    )
    _log_ticks(axes[1], sweep.batch)
    axes[1].legend()
    return axes


def plot_policy_bars(policies: Any, metrics: Sequence[tuple[str, str]], axes: Sequence[Axes] | None = None) -> Any:
    """One panel per ``(column, label with unit)``: a bar per workload and policy (``label`` column)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.4))
    for ax, (metric, label) in zip(axes, metrics):
        pivot = policies.pivot(index="workload", columns="label", values=metric)
        pivot.plot.bar(ax=ax, rot=0)
        ax.set(ylabel=label, xlabel="workload", title=label)
        ax.legend(title="policy")
    return axes


def plot_step_timelines(runs: Mapping[str, Mapping[str, Any]]) -> Any:
    """One panel per scheduler: each engine step a bar (start .. end on that scheduler's own time axis, height
    its duration), coloured by its share of prefill tokens, with a colour bar."""
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.0 * len(runs)), squeeze=False, layout="constrained")
    cmap, norm = plt.get_cmap("viridis"), Normalize(0, 1)
    for ax, (label, run) in zip(axes[:, 0], runs.items()):
        s = run["steps"]
        share = s.num_prefill_tokens / (s.num_prefill_tokens + s.num_decode_tokens).clip(lower=1)
        ax.bar(
            s.start_s * 1e3,
            s.duration_s * 1e3,
            width=s.duration_s * 1e3,
            align="edge",
            color=cmap(norm(share)),
            edgecolor="black",
            linewidth=0.3,
        )
        ax.set(
            ylabel="step time (ms)",
            xlabel="engine time (ms)",
            xlim=(0, float((s.start_s + s.duration_s).max()) * 1e3),
            title=f"{label}: longest step {run['max_step_s'] * 1e3:.0f} ms, worst decode ITL "
            f"{run['stall_itl_max_s'] * 1e3:.0f} ms, long-prompt TTFT {run['long_ttft_s'] * 1e3:.0f} ms",
        )
    fig.colorbar(
        ScalarMappable(norm=norm, cmap=cmap), ax=axes[:, 0].tolist(), label="share of prefill tokens in the step"
    )
    return fig


def plot_budget_tradeoff(sweep: Any, long_prompt_len: int, num_decodes: int, ax: Axes | None = None) -> Axes:
    """Worst decode ITL while the long prompt prefills against its TTFT, one point per chunked token budget;
    labels alternate above and below the points so that neighbours do not overprint."""
    ax = _new_ax(ax)
    ax.plot(sweep.long_ttft_ms, sweep.stall_ms, "o-")
    for i, (_, r) in enumerate(sweep.sort_values("long_ttft_ms").iterrows()):
        dy = 8 if i % 2 == 0 else -14
        ax.annotate(
            f"{int(r.token_budget)}",
            (r.long_ttft_ms, r.stall_ms),
            xytext=(4, dy),
            textcoords="offset points",
            fontsize="small",
        )
    ax.set(
        xlabel="TTFT of the long prompt (ms)",
        ylabel="worst decode ITL while it prefills (ms)",
        title=f"Stall against TTFT per token budget ({long_prompt_len}-token prompt, {num_decodes} decodes)\n"
        "point labels: token budget (tokens per step)",
    )
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


# ---------------------------------------------------------------- figures of the command line (--plot FILE)


def save_figure(fig: Any, path: str) -> str:
    """Write ``fig`` to ``path`` (format from the suffix: .png, .svg, .pdf) with the Agg backend; returns the path."""
    fig.savefig(path, dpi=150, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def use_file_backend() -> None:
    """Select matplotlib's Agg backend (no display needed) and the workbench theme, for commands writing files."""
    import matplotlib

    matplotlib.use("Agg")
    set_theme()


def _cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_latency_cdfs(records: Sequence[Any], title: str) -> Any:
    """Three panels: the CDFs of TTFT, TPOT and E2E latency (ms, log axis) of finished request records."""
    import matplotlib.pyplot as plt

    from workbench.engine.metrics import is_completed, request_latencies

    lats = [request_latencies(r) for r in records if is_completed(r)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, label) in zip(axes, [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2el_s", "E2E latency")]):
        _cdf(ax, [lat[key] * 1e3 for lat in lats if lat[key] is not None and lat[key] > 0], label)
        ax.set(
            xscale="log",
            xlabel=f"{label} (ms)",
            ylabel="share of finished requests",
            ylim=(0, 1.02),
            title=f"{label} CDF ({len(lats)} requests)",
        )
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_serving_timelines(records: Sequence[Any], step_logs: Sequence[Any], title: str) -> Any:
    """Three panels against simulated time: requests waiting for their first token (all replicas), then per
    replica the sequences in each step (batch size) and the KV blocks in use."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    events = sorted(
        [(r.arrival_time, 1) for r in records]
        + [(r.first_token_time, -1) for r in records if r.first_token_time is not None]
    )
    t, n, xs, ys = 0.0, 0, [0.0], [0]
    for t, d in events:
        n += d
        xs.append(t)
        ys.append(n)
    axes[0].step(xs, ys, where="post")
    axes[0].set(ylabel="waiting for first token", title="queue: arrived, no token yet")
    for i, log in enumerate(step_logs):
        if log is None or not log.steps:
            continue
        starts = [s.start_s for s in log.steps]
        axes[1].step(starts, [s.num_seqs for s in log.steps], where="post", label=f"replica {i}", lw=0.8)
        axes[2].step(starts, [s.num_blocks_used for s in log.steps], where="post", label=f"replica {i}", lw=0.8)
    axes[1].set(ylabel="sequences in the step", title="batch size per step")
    axes[2].set(ylabel="KV blocks in use", xlabel="simulated time (s)", title="KV cache occupancy")
    for ax in axes[1:]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(title="replica", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_trace(requests: Sequence[Any], title: str) -> Any:
    """Three panels of a workload: prompt and output length histograms (log bins) and arrivals per second."""
    import math

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label in ((axes[0], "prompt_len", "prompt"), (axes[1], "output_len", "output")):
        values = [getattr(r, key) for r in requests]
        hi = max(values) if values else 1
        bins = [2 ** (i / 4) for i in range(int(4 * math.log2(max(hi, 2))) + 2)]
        ax.hist(values, bins=bins, color="C0" if key == "prompt_len" else "C1", edgecolor="white")
        ax.set(xscale="log", xlabel=f"{label} length (tokens)", ylabel="requests", title=f"{label} lengths")
    arrivals = [r.arrival_time_s for r in requests]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    width = max(span / 100, 1e-3)
    axes[2].hist(arrivals, bins=max(1, min(100, int(span / width) + 1)), color="C2", edgecolor="white")
    axes[2].set(xlabel="arrival time (s)", ylabel=f"requests per {width:.3g} s", title="arrivals over time")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


__all__ = [
    "set_theme",
    "plot_roofline",
    "plot_decode_bytes",
    "plot_phase_times",
    "plot_variant_decode",
    "plot_waste",
    "plot_batch_sweep",
    "plot_policy_bars",
    "plot_step_timelines",
    "plot_budget_tradeoff",
    "figure_summary",
    "save_figure",
    "use_file_backend",
    "plot_latency_cdfs",
    "plot_serving_timelines",
    "plot_trace",
    "BYTE_KIND_COLORS",
]


# ---- notebook 05: disaggregation ---------------------------------------------------------------------------------
def plot_slo_attainment(sweep: Any, slo_text: str, ax: Axes | None = None) -> Axes:
    """SLO attainment (%) against request rate, one line per node layout (colocated replicas or P:D splits)."""
    ax = _new_ax(ax)
    for layout, group in sweep.groupby("layout", sort=False):
        style = "o-" if layout.startswith("colocated") else "s--"
        ax.plot(group.rate, group.slo_attainment, style, label=layout)
    ax.set(xlabel="request rate (requests/s)", ylabel="requests within both SLOs (%)",
           title=f"SLO attainment against load, simulated ({slo_text})")  # fmt: skip
    ax.legend(title="layout (prefill:decode GPUs)", fontsize="small")
    return ax


def plot_link_sweep(links: Any, split: str, ax: Axes | None = None) -> Axes:
    """Goodput per GPU of one P:D split against the KV link's bandwidth (log axis), and the colocated node's."""
    ax = _new_ax(ax)
    ax.plot(links.link_gbps, links.goodput_per_gpu, "s-", label=f"disaggregated {split}")
    ax.axhline(float(links.colocated_goodput_per_gpu.iloc[0]), color="0.4", ls=":", label="colocated (no link)")
    ax.set_xscale("log")
    _log_ticks(ax, list(links.link_gbps))
    ax.set(xlabel="KV link bandwidth per transfer (Gb/s)", ylabel="goodput per GPU (requests/s)",
           title="Goodput per GPU against the KV link, simulated")  # fmt: skip
    ax.legend(fontsize="small")
    return ax


def plot_tp_layouts(sweep: Any, ax: Axes | None = None) -> Axes:
    """Goodput per GPU of every layout (``tp_layouts``) at every rate swept: colocated, split with one TP for both
    phases, split with a TP per phase."""
    ax = _new_ax(ax)
    rates = sorted(set(sweep.rate))
    layouts = list(dict.fromkeys(sweep.layout))
    width = 0.8 / max(len(rates), 1)
    for i, rate in enumerate(rates):
        at = sweep[sweep.rate == rate].set_index("layout")
        values = [float(at.goodput_per_gpu.get(name, float("nan"))) for name in layouts]
        ax.barh([k + i * width for k in range(len(layouts))], values, height=width, label=f"{rate:g} req/s")
    ax.set_yticks([k + 0.4 - width / 2 for k in range(len(layouts))], layouts, fontsize="small")
    ax.invert_yaxis()
    ax.set(xlabel="goodput per GPU (requests/s)", title="Layouts of the node by tensor-parallel size, simulated")
    ax.legend(fontsize="small")
    return ax


def plot_tp_sweep(sweep: Any, hardware: str, axes: Sequence[Axes] | None = None) -> Sequence[Axes]:
    """TTFT and ITL (wall time on the group) against the tensor-parallel size per model, and their GPU-seconds
    (latency x GPUs, dashed); sizes whose weights do not fit are left out."""
    import matplotlib.pyplot as plt

    if axes is None:
        _fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), constrained_layout=True)
    fits = sweep[sweep.fits]
    for ax, (phase, label) in zip(axes, (("ttft", "TTFT (prefill)"), ("itl", "ITL (decode step)"))):
        for name, g in fits.groupby("model", sort=False):
            (line,) = ax.plot(g.tp, g[f"{phase}_s"] * 1e3, "o-", label=f"{name}: latency")
            ax.plot(g.tp, g[f"{phase}_gpu_s"] * 1e3, "s--", color=line.get_color(), alpha=0.7,
                    label=f"{name}: GPU-ms (x TP)")  # fmt: skip
        ax.set_xscale("log", base=2)
        _log_ticks(ax, sorted(set(fits.tp)))
        ax.set_yscale("log")
        ax.set(xlabel="tensor-parallel size (GPUs)", ylabel="ms", title=f"{label} on {hardware}, roofline with comm")
        ax.legend(fontsize="small")
    return axes


def plot_pareto(rows: Any, front: Any, title: str, ax: Axes | None = None) -> Axes:
    """Every simulated deployment's goodput per GPU against its p90 TTFT, the Pareto front joined and labelled."""
    import matplotlib.pyplot as plt

    ax = _new_ax(ax)
    sc = ax.scatter(rows.ttft_p90_s * 1e3, rows.goodput_per_gpu, c=rows.num_gpus, cmap="viridis", s=28, alpha=0.7)
    plt.colorbar(sc, ax=ax, label="GPUs")
    f = front.sort_values("ttft_p90_s")
    ax.plot(f.ttft_p90_s * 1e3, f.goodput_per_gpu, "k.-", lw=1, label="Pareto front")
    for _, r in f.iterrows():
        ax.annotate(r["name"], (r.ttft_p90_s * 1e3, r.goodput_per_gpu), fontsize="x-small", xytext=(3, 3),
                    textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set(xlabel="p90 TTFT (ms)", ylabel="goodput per GPU (requests/s within SLOs)", title=title)
    ax.legend(fontsize="small")
    return ax


def plot_fidelity(rows: Any, axes: Sequence[Axes] | None = None) -> Sequence[Axes]:
    """Notebook 07: one panel per statistic (``statistic`` column); per policy the measured median with its
    min..max over the repeats as an error bar, and each cost model's simulated value as a marker (ms)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(rows)
    stats = list(dict.fromkeys(df["statistic"]))
    if axes is None:
        _, axes = plt.subplots(1, len(stats), figsize=(4.2 * len(stats), 4.2), constrained_layout=True)
    markers = ["o", "s", "^", "D", "v", "P"]
    for ax, stat in zip(axes, stats):
        sub = df[df["statistic"] == stat]
        policies = list(dict.fromkeys(sub["policy"]))
        x = range(len(policies))
        first = sub.drop_duplicates("policy").set_index("policy").loc[policies]
        err = [first["measured_ms"] - first["measured_min_ms"], first["measured_max_ms"] - first["measured_ms"]]
        ax.errorbar(x, first["measured_ms"], yerr=err, fmt="_", color="black", markersize=16, capsize=4,
                    label="measured (median, min..max)")  # fmt: skip
        for i, (label, part) in enumerate(sub.groupby("model", sort=False)):
            part = part.set_index("policy").loc[policies]
            ax.scatter(x, part["simulated_ms"], marker=markers[i % len(markers)], label=f"simulated: {label}", zorder=3)
        ax.set_xticks(list(x), policies, rotation=30, ha="right")
        ax.set(ylabel=f"{stat} (ms)", title=stat)
    axes[0].legend(fontsize="small")
    return axes


def plot_step_breakdown(rows: Any, ax: Axes | None = None) -> Axes:
    """Notebook 07: stacked bars of where each named step's time goes by the op profile (``step``, ``part``,
    ``ms`` rows), in ms."""
    import pandas as pd

    ax = _new_ax(ax)
    df = pd.DataFrame(rows)
    pivot = df.pivot_table(index="step", columns="part", values="ms", aggfunc="sum", sort=False).fillna(0.0)
    pivot = pivot[pivot.sum().sort_values(ascending=False).index]
    (pivot.div(pivot.sum(axis=1), axis=0) * 100).plot.barh(stacked=True, ax=ax, width=0.7, colormap="tab20")
    ax.set(xlabel="share of the predicted step time (%)", ylabel="step", title="Where a step's time goes (op profile)")
    ax.legend(fontsize="x-small", ncol=2, bbox_to_anchor=(1.01, 1.0), loc="upper left")
    return ax


def plot_decode_levers(rows: Any, ax: Axes | None = None) -> Axes:
    """Decode tokens/s against bytes read per generated token, one line per batch size, each point a storage scheme
    (min..max bars): the fewer bytes a token needs, the faster decode runs while it is bandwidth-bound."""
    ax = _new_ax(ax)
    for batch, grp in rows.groupby("batch", sort=True):
        grp = grp.sort_values("bytes_per_token")
        err = [grp.tokens_per_s - grp.tokens_per_s_min, grp.tokens_per_s_max - grp.tokens_per_s]
        ax.errorbar(grp.bytes_per_token / 1e6, grp.tokens_per_s, yerr=err, fmt="o-", capsize=3, label=f"batch {batch}")
        for _, r in grp.iterrows():
            ax.annotate(r["scheme"], (r["bytes_per_token"] / 1e6, r["tokens_per_s"]), xytext=(4, 3),
                        textcoords="offset points", fontsize=7)  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="bytes read per generated token (MB)", ylabel="decode tokens/s",
           title="Decode throughput against bytes per token, per storage scheme")  # fmt: skip
    ax.legend(title="sequences per step")
    return ax


def plot_accuracy_speed(decode: Any, accuracy: Any, batch: int, ax: Axes | None = None) -> Axes:
    """Speed-up of batch-``batch`` decode over the unquantized model against the accuracy it costs (KL divergence
    of the logits from the unquantized model's, log scale; the unquantized point itself has KL 0 and is left out)."""
    ax = _new_ax(ax)
    merged = decode[decode.batch == batch].merge(accuracy, on="scheme")
    shown = merged[merged.kl > 0]
    ax.scatter(shown.kl, shown.speedup, s=60, color="C0")
    for _, r in shown.iterrows():
        ax.annotate(f"{r['scheme']} (top-1 {r['top1_agreement']:.0%})", (r["kl"], r["speedup"]), xytext=(4, 3),
                    textcoords="offset points", fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set(xscale="log", xlabel="KL divergence from the unquantized logits (nats, mean over positions)",
           ylabel=f"decode speed-up at batch {batch} (x)", title="Speed gained against accuracy lost")  # fmt: skip
    return ax


def plot_phase_speedups(decode: Any, prefill: Any, batch: int, ax: Axes | None = None) -> Axes:
    """Per scheme, its speed-up over the unquantized model in batch-``batch`` decode and in prefill (TTFT), side
    by side: fewer bytes move the bandwidth-bound phase, not the compute-bound one."""
    import numpy as np

    ax = _new_ax(ax)
    dec = decode[decode.batch == batch].set_index("scheme")["speedup"]
    pre = prefill.groupby("scheme", sort=False)["speedup"].first()
    labels = [s for s in dec.index if s in pre.index]
    x = np.arange(len(labels))
    ax.bar(x - 0.2, [dec[s] for s in labels], width=0.4, label=f"decode, batch {batch}", color="#0173B2")
    ax.bar(x + 0.2, [pre[s] for s in labels], width=0.4, label="prefill (TTFT)", color="#DE8F05")
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xticks(x, labels)
    ax.set(ylabel="speed-up over the unquantized model (x)", xlabel="storage scheme",
           title="Fewer bytes per weight: decode against prefill")  # fmt: skip
    ax.legend()
    return ax


def plot_trials(comparisons: Mapping[str, Any], ax: Axes | None = None) -> Axes:
    """One row per paired comparison (``trials.Comparison``, keyed by a short name): each round's B/A ratio (dots)
    and A/A control ratio (crosses), the mean B/A with its interval (bar), the band of +-margin around 1 (grey) and
    1 itself; log ratio axis. The per-round spread is what the interval is made of."""
    import math

    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(7.5, 1.0 + 0.9 * len(comparisons)))
    names = list(comparisons)
    for y, name in enumerate(names):
        c = comparisons[name]
        a, b = c.arms
        ratios = [vb / va for va, vb in zip(c.values[a], c.values[b])]
        ax.scatter(ratios, [y + 0.12] * len(ratios), s=14, color="#0173B2", alpha=0.7,
                   label="B/A per round" if y == 0 else None)  # fmt: skip
        control = c.values.get(f"{a} (A/A)")
        if control:
            aa = [vc / va for va, vc in zip(c.values[a], control)]
            ax.scatter(aa, [y - 0.12] * len(aa), s=14, marker="x", color="#666666",
                       label="A/A per round" if y == 0 else None)  # fmt: skip
        ax.errorbar(c.ratio, y + 0.12, xerr=[[c.ratio - c.ci_low], [c.ci_high - c.ratio]], fmt="D", color="#D55E00",
                    capsize=4, label=f"B/A mean, {c.rule.confidence:.0%} interval" if y == 0 else None)  # fmt: skip
        m = math.log1p(c.rule.margin)
        ax.fill_between([math.exp(-m), math.exp(m)], y - 0.4, y + 0.4, color="#cccccc", alpha=0.5, lw=0,
                        label="+-margin" if y == 0 else None)  # fmt: skip
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{n}\n{comparisons[n].arms[1]} / {comparisons[n].arms[0]}" for n in names], fontsize="small")
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.set(xlabel="ratio B/A (log scale)", title="Paired rounds: per-round ratios and the interval of their mean")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small")
    return ax


def plot_speculative_speedup(rows: Any, roofline_rows: Any, ax: Axes | None = None) -> Axes:
    """Speculative decoding's speed-up against batch size (09): measured (the ratio of medians, with each round's
    ratio as dots), the simulator's prediction for the same run, and the roofline's expected speed-up; 1 (no gain)
    dotted. ``rows``: ``speedup_against_batch`` rows; ``roofline_rows``: ``roofline_speedups`` rows."""
    ax = _new_ax(ax)
    batches = [r["batch"] for r in rows]
    ax.plot(batches, [r["measured_speedup"] for r in rows], "o-", color="#0173B2", label="measured (engine)")
    for r in rows:
        ax.scatter([r["batch"]] * len(r["speedup_per_round"]), r["speedup_per_round"], s=12, color="#0173B2",
                   alpha=0.4)  # fmt: skip
    ax.plot(batches, [r["predicted_speedup"] for r in rows], "s--", color="#DE8F05", label="simulated (same run)")
    ax.plot([r["batch"] for r in roofline_rows], [r["speedup"] for r in roofline_rows], "^:", color="#029E73",
            label="roofline (measured ceilings)")  # fmt: skip
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size (sequences)", ylabel="tokens/s with speculation / without (x)",
           title="Speculative decoding's speed-up against batch size")  # fmt: skip
    ax.legend()
    return ax
