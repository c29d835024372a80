"""Plots of results: speed, memory by category, loss curves, step times. Each names its units and device.

Every figure here is a `matplotlib.figure.Figure` built with the object API, never through pyplot: nothing is
registered with pyplot's global figure manager, so nothing accumulates there (no plt.close needed) and a figure
built in a widget's callback (widgets.Panel) is never shown a second time by the inline backend. In a cell,
show one with `display(fig)` or by leaving `fig` as the cell's last expression (`plt.show()` shows only pyplot's
own figures, not these)."""

from __future__ import annotations

import io
import math
from typing import Callable, Union

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .measure import CATEGORIES
from .results import RunResult

CATEGORY_COLORS = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#a0a0a0")))


def _devices(results: list[RunResult]) -> str:
    names = sorted({r.provenance.get("device", "?") for r in results})
    torch_versions = sorted({r.provenance.get("torch", "?") for r in results})
    return f"{' / '.join(names)}, torch {' / '.join(torch_versions)}"


def new_figure(figsize, layout="constrained") -> Figure:
    """A figure outside pyplot, with an Agg canvas (renders to PNG: savefig, display in a notebook)."""
    _displayable_in_ipython()
    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig: Figure) -> bytes:
    """The figure as PNG bytes, drawn as a notebook's inline backend draws it (tight box: legends outside the axes
    stay in), for an ipywidgets.Image: how widgets.Panel shows its figure from a button's callback."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _displayable_in_ipython() -> None:
    """Make `display(fig)` show a PNG in a notebook even before pyplot has made a figure there: IPython only
    knows how to render a Figure once pyplot's inline backend has been activated (which registers the same kind
    of PNG formatter, and replaces this one when it does)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None or not hasattr(ip, "display_formatter"):
        return
    png = ip.display_formatter.formatters["image/png"]
    try:
        png.lookup_by_type(Figure)
    except KeyError:
        from IPython.core.pylabtools import print_figure

        png.for_type(Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight"))


def _new_axes(ax, figsize=(7, 3.2)):
    if ax is not None:
        return ax.figure, ax
    fig = new_figure(figsize)
    return fig, fig.subplots()


def plot_speed(results: list[RunResult], ax=None, baseline: RunResult | None = None) -> Figure:
    """tokens/s per run, each bar labelled with its speed-up over the baseline (the first ok run)."""
    fig, ax = _new_axes(ax)
    base = baseline or next((r for r in results if r.ok), None)
    labels = [r.label for r in results]
    values = [r.tokens_per_s if r.ok else 0.0 for r in results]
    bars = ax.bar(range(len(results)), values, color=["#4c72b0" if r.ok else "#dddddd" for r in results])
    for bar, r in zip(bars, results):
        text = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if r.ok and base else r.status.upper()
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(results)), [tick(lab) for lab in labels], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (median step)")
    ax.set_title(f"Throughput, speed-up vs {base.label if base else 'n/a'}\n{_devices(results)}", fontsize=9)
    ax.margins(y=0.15)
    return fig


def plot_memory(results: list[RunResult], ax=None) -> Figure:
    """Peak memory as stacked bars by category, in GiB. A category the device could not measure (CUDA: the
    activations and logits, inside "other") has no bar, and a run without a memory report says so."""
    fig, ax = _new_axes(ax)
    bottoms = [0.0] * len(results)
    for cat in CATEGORIES:
        vals = [(r.memory_gib().get(cat) or 0.0) if r.ok else 0.0 for r in results]
        ax.bar(range(len(results)), vals, bottom=bottoms, label=cat, color=CATEGORY_COLORS[cat])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, r in enumerate(results):
        if not r.ok or not r.memory:
            ax.annotate(
                r.status.upper() if not r.ok else "not measured",
                (i, 0),
                ha="center",
                va="bottom",
                fontsize=8,
                color="#c44e52",
            )
        elif r.peak_is_reserved:  # beside live peaks: say which bar is the allocator's reserved memory
            ax.annotate("reserved", (i, bottoms[i]), ha="center", va="bottom", fontsize=7, color="#555555")
    ax.set_xticks(range(len(results)), [tick(r.label) for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("peak memory (GiB)")
    methods = sorted({r.memory.get("method", "").split(":")[0] for r in results if r.ok and r.memory})
    ax.set_title(f"Peak memory by category ({'; '.join(methods) or 'n/a'})\n{_devices(results)}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


MAX_TICK = 26  # characters of a run's label on an axis; the results table has the whole of it
MAX_LEGEND = 12  # legend entries: a panel's figure stays readable after many runs


def placeholder(ax, text: str) -> None:
    """Grey text in the middle of an empty panel plot, saying which run would fill it."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8, color="grey")


def tick(label: str) -> str:
    """A run's label short enough for an axis: a long one keeps its "#n" and its start."""
    return label if len(label) <= MAX_TICK else label[: MAX_TICK - 1].rstrip(" ,") + "…"


def _legend(ax) -> None:
    """A legend beside the axes once there are several lines (inside, it would cover them), with at most MAX_LEGEND
    entries (the latest), labels shortened as on an axis."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    if len(handles) > MAX_LEGEND:
        handles, labels = handles[-MAX_LEGEND:], labels[-MAX_LEGEND:]
        labels[0] = f"(the last {MAX_LEGEND}) " + labels[0]
    labels = [tick(lab) if len(lab) > 2 * MAX_TICK else lab for lab in labels]
    if len(handles) <= 4:
        ax.legend(handles, labels, fontsize=7)
    else:
        ax.legend(handles, labels, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _label(ax, xlabel: str, ylabel: str, title: str, results: list[RunResult]) -> None:
    """Axis labels with units, the title with the devices the results came from, a legend when there are lines."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{_devices(results)}", fontsize=9)
    if ax.lines:
        _legend(ax)


def plot_losses(results: list[RunResult], ax=None, validation: bool = True) -> Figure:
    """Training loss per optimizer step (and validation loss where measured), one line per run."""
    fig, ax = _new_axes(ax)
    for r in results:
        if not r.losses:
            continue
        (line,) = ax.plot(range(len(r.losses)), r.losses, label=f"{r.label} (train)", lw=1.2)
        if validation and r.val_losses:
            steps, vals = zip(*r.val_losses)
            ax.plot(steps, vals, "o--", color=line.get_color(), label=f"{r.label} (val)", ms=3, lw=1)
    _label(ax, "optimizer step", "cross-entropy (nats/token)", "Loss curves", results)
    return fig


def plot_step_times(results: list[RunResult], ax=None) -> Figure:
    """Time of every step in ms, log scale; steps left out of the median (warm-up/compile, ledger) hollow."""
    fig, ax = _new_axes(ax)
    for r in results:
        if not r.step_times:
            continue
        ms = [t * 1e3 for t in r.step_times]
        (line,) = ax.plot(range(len(ms)), ms, "-", lw=1, label=r.label)
        ex = [i for i in r.excluded_steps if i < len(ms)]
        ax.plot(ex, [ms[i] for i in ex], "o", mfc="none", color=line.get_color(), ms=6)
    ax.set_yscale("log")
    _label(
        ax,
        "step (hollow: warm-up / compile or memory-ledger steps, left out of the median)",
        "step time (ms)",
        "Step times",
        results,
    )
    return fig


def plot_grad_norms(results: list[RunResult], ax=None) -> Figure:
    """The global gradient norm of every step (logged before clipping), log scale, one line per run; a run's
    clipping threshold as a dashed line of its colour, a step whose norm was not finite (fp16 overflow) as an x."""
    fig, ax = _new_axes(ax)
    for r in results:
        if not r.grad_norms:
            continue
        finite = [(i, g) for i, g in enumerate(r.grad_norms) if math.isfinite(g) and g > 0]
        (line,) = ax.plot(*zip(*finite), lw=1.2, label=r.label) if finite else ax.plot([], [], label=r.label)
        bad = [i for i, g in enumerate(r.grad_norms) if not math.isfinite(g)]
        if bad:
            ax.plot(bad, [max((g for _, g in finite), default=1.0)] * len(bad), "x", color=line.get_color(), ms=7)
        clip = (r.config or {}).get("clip_norm")
        if clip:
            ax.axhline(clip, ls="--", lw=0.9, color=line.get_color())
    ax.set_yscale("log")
    _label(
        ax,
        "optimizer step (dashed: clipping threshold)",
        "global gradient norm, before clipping",
        "Gradient norm",
        results,
    )
    return fig


def plot_lrs(results: list[RunResult], ax=None) -> Figure:
    """The learning rate each optimizer step used, one line per run."""
    fig, ax = _new_axes(ax)
    for r in results:
        if r.lrs:
            ax.plot(range(len(r.lrs)), r.lrs, lw=1.2, label=r.label)
    _label(ax, "optimizer step", "learning rate", "Learning-rate schedule", results)
    return fig


def _pair_ticks(ax, names: list[str]) -> None:
    ax.set_xticks(
        [3 * i + j for i in range(len(names)) for j in range(2)],
        [f"{tick(n)} ({w})" for n in names for w in ("formula", "measured")],
        rotation=35,
        ha="right",
        fontsize=7,
    )


def plot_formula_beside_measured(
    pairs: dict[str, tuple[dict, dict | None]], ax=None, title: str = "Memory by category"
) -> Figure:
    """Formula beside measurement, category by category: for each name a pair of stacked bars, the formula's bytes
    (hatched) and the measured bytes (solid; a category the device could not measure, None, has no bar), the measured
    bar labelled with its total's difference from the formula's. MiB, or GiB where a total passes 1 GiB."""
    fig, ax = _new_axes(ax)
    total = lambda d: sum(v or 0 for v in d.values())  # noqa: E731
    unit, size = (
        ("GiB", 2**30) if max((total(d) for p in pairs.values() for d in p if d), default=0) > 2**30 else ("MiB", 2**20)
    )
    # the course's categories, then any a caller merged (plot_memory_vs_estimate on CUDA), in their order
    keys = [*CATEGORIES, *dict.fromkeys(k for p in pairs.values() for d in p for k in (d or {}) if k not in CATEGORIES)]
    present = [c for c in keys if any((d or {}).get(c) for p in pairs.values() for d in p)]
    for i, (name, (predicted, measured)) in enumerate(pairs.items()):
        for j, d in enumerate((predicted, measured)):
            bottom = 0.0
            for cat in present:
                v = ((d or {}).get(cat) or 0) / size
                ax.bar(
                    3 * i + j,
                    v,
                    bottom=bottom,
                    color=CATEGORY_COLORS.get(cat, "#d0d0d0"),
                    hatch="//" if j == 0 else None,
                    edgecolor="white",
                    label=cat if (i, j) == (0, 1) else None,
                )
                bottom += v
        if measured:
            ax.annotate(
                f"{round(total(measured) / total(predicted) - 1, 3) + 0.0:+.1%}",
                (3 * i + 1, total(measured) / size),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    _pair_ticks(ax, list(pairs))
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(f"{title}: formula (hatched) beside measured", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.12)
    return fig


def _measured_apart(predicted: dict, measured: dict) -> tuple[dict, dict, str]:
    """The formula and the measurement over only the categories the device measured apart. The CUDA allocator gives
    one peak: the tensors' own sizes give parameters, optimizer state (and gradients when they live all step), and
    the rest of the peak, activations and logits among it, is one number ("other"). The categories measured as None
    are merged with "other" on both sides into one bar, so that no bar claims a split nobody measured. Returns
    (predicted, measured, the merged bar's name, or "" when every category was measured)."""
    merged = [c for c in CATEGORIES if c != "other" and measured.get(c) is None]
    if not merged:
        return predicted, measured, ""
    name = f"{' + '.join(merged)} + other (one total)"

    def fold(d: dict) -> dict:
        return {
            **{c: v for c, v in d.items() if c not in merged and c != "other"},
            name: sum(d.get(c) or 0 for c in (*merged, "other")),
        }

    return fold(predicted), fold(measured), name


def plot_memory_vs_estimate(results: list[RunResult], ax=None, last: int = 3) -> Figure:
    """The last `last` runs that carry the formula's prediction (memory_estimate.run_beside_estimate:
    details["estimate"]), each as the estimate's peak beside the measured peak, category by category
    (plot_formula_beside_measured). On CUDA only the categories the allocator's peak lets apart are compared
    (_measured_apart), and the title says so."""
    shown = [r for r in results if r.ok and r.memory and "estimate" in r.details][-last:]
    pairs, merged = {}, set()
    for r in shown:
        predicted, measured, name = _measured_apart(r.details["estimate"]["by_category"], r.memory["by_category"])
        pairs[r.label] = (predicted, measured)
        merged.update([name] if name else [])
    fig = plot_formula_beside_measured(pairs, ax, "Peak by category")
    ax = ax or fig.axes[0]
    methods = sorted({r.memory.get("method", "").split(":")[0] for r in shown})
    note = "; ".join(methods) or "no run with an estimate"
    if merged:
        note += (
            " (the allocator gives only the peak, not its split: "
            + "; ".join(n.removesuffix(" (one total)") for n in sorted(merged))
            + " drawn as one bar)"
        )
    ax.set_title(f"{ax.get_title()}\n{note}\n{_devices(shown or results)}", fontsize=9)
    return fig


def plot_time_vs_flops(results: list[RunResult], ax=None, last: int = 3) -> Figure:
    """Time, formula beside measurement: for the last `last` ok runs with an MFU, the time the model's FLOPs (6N +
    12·L·h·s per token, measure.flops_per_token) take at the device's peak (hatched: a data sheet's, or the matmul peak
    measured on this machine), which is the measured step time x MFU, beside the measured median step (solid), labelled
    with the MFU (a data sheet's peak) or the efficiency (a measured one). Log scale: on a CPU the two are orders of
    magnitude apart."""
    fig, ax = _new_axes(ax)
    shown = [r for r in results if r.ok and r.median_step_s and r.mfu][-last:]
    for i, r in enumerate(shown):
        ms = r.median_step_s * 1e3
        ax.bar(
            3 * i,
            ms * r.mfu,
            color="white",
            edgecolor="#4c72b0",
            hatch="//",
            label="6N + 12Lhs FLOPs at the peak" if i == 0 else None,
        )
        ax.bar(3 * i + 1, ms, color="#4c72b0", label="measured median step" if i == 0 else None)
        # MFU proper against a data sheet; elsewhere the efficiency against this machine's measured matmul peak
        kind = "MFU" if r.mfu_basis == "data-sheet peak" else "efficiency"
        ax.annotate(f"{kind} {r.mfu:.1%}", (3 * i + 1, ms), ha="center", va="bottom", fontsize=7)
    _pair_ticks(ax, [r.label for r in shown])
    ax.set_yscale("log")
    ax.set_ylabel("ms per optimizer step (log scale)")
    basis = "; ".join(sorted({r.mfu_basis for r in shown})) or "no run with an MFU"
    ax.set_title(f"Step time: FLOPs at the peak ({basis}) beside measured\n{_devices(shown or results)}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_will_it_fit(est, device_gib: float, title: str = "") -> Figure:
    """A predicted peak (memory_formula.Estimate) as one bar stacked by category, beside a device's memory (the
    vertical line)."""
    fig = new_figure((7, 2.2))
    ax = fig.add_subplot()
    left = 0.0
    for cat, v in est.by_category.items():
        ax.barh(0, v / 2**30, left=left, color=CATEGORY_COLORS[cat], label=f"{cat} {v / 2**30:.2f} GiB")
        left += v / 2**30
    ax.axvline(device_gib, color="k", lw=1.5)
    ax.text(device_gib, -0.3, f" device: {device_gib:g} GiB", fontsize=8, va="center")
    ax.set_yticks([])
    ax.set_xlabel("GiB (predicted peak, formula)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1.2))
    ax.set_title(title, fontsize=9)
    return fig


PHASE_COLORS = {
    "forward": "#4c72b0",
    "loss": "#8172b3",
    "backward": "#c44e52",
    "optimizer": "#55a868",
    "other": "#a0a0a0",
}


def plot_step_timelines(reports: dict, title: str = "") -> Figure:
    """Live tensor memory after every operation of one step, a panel per report ({name: measure.MemoryReport}: the
    ledger's timeline of (phase, live bytes)), coloured by phase, a dotted line at the report's peak; the panels share
    the y axis."""
    fig = new_figure((5.5 * len(reports), 3.4))
    axes = fig.subplots(1, len(reports), sharey=True, squeeze=False)[0]
    for ax, (name, rep) in zip(axes, reports.items()):
        by_phase: dict[str, list] = {}
        for i, (phase, live) in enumerate(rep.timeline):
            by_phase.setdefault(phase, []).append((i, live / 2**20))
        for phase, points in by_phase.items():
            ax.plot(*zip(*points), ".", ms=2, color=PHASE_COLORS.get(phase, "k"), label=phase)
        ax.axhline(rep.peak_bytes / 2**20, color="k", lw=0.6, ls=":")
        ax.set_title(f"{name}: peak {rep.peak_bytes / 2**20:.2f} MiB", fontsize=9)
        ax.set_xlabel("operation number")
    axes[0].set_ylabel("live tensor memory (MiB)")
    axes[-1].legend(fontsize=7, markerscale=4)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


PLOTS = {
    "speed": plot_speed,
    "memory": plot_memory,
    "loss": plot_losses,
    "step_times": plot_step_times,
    "grad_norm": plot_grad_norms,
    "lr": plot_lrs,
    "memory_vs_estimate": plot_memory_vs_estimate,
    "time_vs_flops": plot_time_vs_flops,
}
# One panel of a figure: a name in PLOTS, or fn(results, ax) drawing every run on the Axes it is given.
PlotSpec = Union[str, Callable[[list, object], object]]


def plot_results(results: list[RunResult], which: tuple[PlotSpec, ...] = ("speed", "memory")) -> Figure:
    """Several plots side by side in one figure: each entry of `which` a name in PLOTS or a callable fn(results, ax)."""
    for spec in which:
        if not callable(spec) and spec not in PLOTS:
            raise KeyError(f"no plot named {spec!r}: use one of {', '.join(PLOTS)} or a function fn(results, ax)")
    fig = new_figure((5.2 * len(which), 3.6))
    axes = fig.subplots(1, len(which), squeeze=False)
    for ax, spec in zip(axes[0], which):
        (spec if callable(spec) else PLOTS[spec])(results, ax)
    return fig


def ladder_speedups(results: list[RunResult]) -> dict[int, float]:
    """{index: speed-up over naive fp32} of a climb's ok rows: what the ladder measured in pairs (its `speedup`), or for
    results without it (a plain list of runs, an older file) tokens/s over the first ok run's."""
    base = next((r for r in results if r.ok and r.tokens_per_s), None)
    out = {}
    for i, r in enumerate(results):
        if not r.ok:
            continue
        paired = (r.ladder or {}).get("speedup")
        if paired:
            out[i] = paired
        elif base and r.tokens_per_s and not r.ladder:
            out[i] = r.tokens_per_s / base.tokens_per_s
    return out


def plot_ladder(results: list[RunResult], reference: list[RunResult] | None = None, target: float = 10.0) -> Figure:
    """The ladder climbed: speed-up over naive fp32 (left) and peak memory by category with the factor saved (right).
    The line joins the rungs that were kept (the best loop so far at each height); a rung that was not kept is a grey
    cross at the speed-up it measured; a skipped or failed rung keeps its place, marked with its status. `reference`
    (e.g. shipped GPU results, matched by rung label) adds its own speed-up line; `target` draws the course's promise
    (about 10x) as a dashed line."""
    fig = new_figure((12, 4.4))
    ax_speed, ax_mem = fig.subplots(1, 2)
    labels = [r.label for r in results]
    xs = range(len(results))
    mine = ladder_speedups(results)
    kept = {i: v for i, v in mine.items() if (results[i].ladder or {}).get("kept", True)}
    if kept:
        ax_speed.plot(
            list(kept), list(kept.values()), "o-", color="#4c72b0", label=f"this machine, kept: {_devices(results)}"
        )
    dropped = {i: v for i, v in mine.items() if i not in kept}
    if dropped:
        ax_speed.plot(
            list(dropped), list(dropped.values()), "x", color="#999999", ms=8, mew=2, label="measured, not kept"
        )
    for i, v in mine.items():
        ax_speed.annotate(
            f"{v:.2f}x",
            (i, v),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
            color="#4c72b0" if i in kept else "#777777",
        )
    for i, r in zip(xs, results):
        if not r.ok:
            ax_speed.annotate(
                r.status.upper(), (i, 1.0), ha="center", va="bottom", fontsize=8, color="#c44e52", rotation=90
            )
    if reference:
        ref = {r.label: v for r, v in ((reference[i], v) for i, v in ladder_speedups(reference).items())}
        rpts = [(i, ref[lab]) for i, lab in zip(xs, labels) if lab in ref]
        if rpts:
            ax_speed.plot(*zip(*rpts), "s--", color="#dd8452", label=f"reference: {_devices(reference)}")
    if target:
        ax_speed.axhline(target, ls=":", color="#888888", label=f"the course's promise (~{target:g}x)")
    ax_speed.axhline(1.0, lw=0.8, color="#cccccc")
    ax_speed.set_yscale("log")
    ax_speed.set_xticks(list(xs), [tick(lab) for lab in labels], rotation=30, ha="right", fontsize=8)
    ax_speed.set_ylabel("speed-up over naive fp32 (x, log scale)")
    ax_speed.set_title("Speed, rung by rung", fontsize=9)
    ax_speed.legend(fontsize=7, loc="upper left")

    plot_memory(results, ax=ax_mem)
    base = next((r for r in results if r.ok and r.peak_gib), None)
    for i, r in zip(xs, results):  # short labels: eleven bars side by side
        if r.ok and base and r.peak_ratio(base):
            ax_mem.annotate(
                f"{r.peak_ratio(base):.2f}x",
                (i, r.peak_gib),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=7,
            )
    if base:
        ax_mem.set_title(ax_mem.get_title().replace("\n", f"; labels: peak over {base.label}'s\n", 1), fontsize=9)
    ax_mem.margins(y=0.15)
    return fig


def plot_climbs(climbs: list[tuple[str, list[RunResult]]], promise: float = 10.0) -> Figure:
    """Several devices' ladders on shared axes, one colour each (`climbs`: (name, a climb's results)), rung by rung:
    speed-up over naive fp32 (left) and peak memory over naive fp32's (right), both on log scales. A filled marker
    joined by the line is a kept rung, a hollow one a rung measured and not kept; a rung a device did not climb, or
    whose peak was not measured, has no marker. `promise` draws the course's promise (about 10x faster in 10x less
    memory) as dotted lines."""
    fig = new_figure((12, 5.2))
    ax_speed, ax_mem = fig.subplots(1, 2)
    rungs = list(dict.fromkeys(r.label for _, results in climbs for r in results))
    colors = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52")
    for (name, results), color in zip(climbs, colors):
        at = {r.label: rungs.index(r.label) for r in results}
        base = next((r for r in results if r.ok and r.peak_gib), None)
        speed = {at[results[i].label]: v for i, v in ladder_speedups(results).items()}
        memory = {at[r.label]: r.peak_gib / base.peak_gib for r in results if r.ok and r.peak_gib and base}
        kept = {at[r.label] for r in results if r.ok and (r.ladder or {}).get("kept", True)}
        for ax, values, text in ((ax_speed, speed, "{:.2f}x"), (ax_mem, memory, "{:.2f}")):
            line = sorted((x, v) for x, v in values.items() if x in kept)
            if line:
                ax.plot(*zip(*line), "o-", color=color, label=f"{name}: {_devices(results)}")
                x, v = line[-1]  # the loop the climb ended with, labelled
                ax.annotate(text.format(v), (x, v), textcoords="offset points", xytext=(6, 0), va="center", fontsize=8)
            dropped = sorted((x, v) for x, v in values.items() if x not in kept)
            if dropped:
                ax.plot(*zip(*dropped), "o", mfc="none", color=color)
    if promise:
        ax_speed.axhline(promise, ls=":", color="#888888", label=f"the course's promise (~{promise:g}x)")
        ax_mem.axhline(1 / promise, ls=":", color="#888888", label=f"the course's promise (~1/{promise:g})")
    for ax, ylabel, title in (
        (ax_speed, "speed-up over naive fp32 (x, log scale)", "Speed, rung by rung (hollow: measured, not kept)"),
        (ax_mem, "peak memory / naive fp32's (log scale)", "Peak memory, rung by rung"),
    ):
        ax.axhline(1.0, lw=0.8, color="#cccccc")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rungs)), [tick(lab) for lab in rungs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
    fig.legend(*ax_speed.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8)
    return fig
