"""Plots of results (speed, memory by category, losses, step times), each naming its units and device. Built without
pyplot, so nothing piles up in its figure manager nor shows twice from a widget: show one with `display(fig)`."""

from __future__ import annotations

import io
import math
from typing import Callable, Union

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .measure import CATEGORIES, GiB
from .results import RunResult

CATEGORY_COLORS = dict(zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#a0a0a0")))


def devices_text(results: list[RunResult]) -> str:
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
    """The figure as PNG bytes, drawn as the inline backend does (legends outside kept), for a widget's Image."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", facecolor="white")
    return buf.getvalue()


def _displayable_in_ipython() -> None:
    """Let `display(fig)` show a PNG before pyplot's inline backend (which registers the same formatter) is active."""
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import print_figure
    except ImportError:
        return
    formatter = getattr(get_ipython(), "display_formatter", None)
    png = formatter.formatters["image/png"] if formatter else None
    if png is not None and png.for_type(Figure) is None:  # only looks up: the inline backend's stays
        png.for_type(Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight"))


def new_axes(ax, figsize=(7, 3.2)):
    ax = ax if ax is not None else new_figure(figsize).subplots()
    return ax.figure, ax


def plot_speed(results: list[RunResult], ax=None, baseline: RunResult | None = None) -> Figure:
    """tokens/s per run, each bar labelled with its speed-up over the baseline (the first ok run)."""
    fig, ax = new_axes(ax)
    base = baseline or next((r for r in results if r.ok), None)
    values = [r.tokens_per_s if r.ok else 0.0 for r in results]
    bars = ax.bar(range(len(results)), values, color=["#4c72b0" if r.ok else "#dddddd" for r in results])
    for bar, r in zip(bars, results):
        text = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if r.ok and base else r.status.upper()
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(results)), [tick(r.label) for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (median step)")
    ax.set_title(f"Throughput, speed-up vs {base.label if base else 'n/a'}\n{devices_text(results)}", fontsize=9)
    ax.margins(y=0.15)
    return fig


def plot_memory(results: list[RunResult], ax=None) -> Figure:
    """Peak memory as stacked bars by category, in GiB. A category the device could not measure (CUDA: the
    activations and logits, inside "other") has no bar, and a run without a memory report says so."""
    fig, ax = new_axes(ax)
    bottoms = [0.0] * len(results)
    for cat in CATEGORIES:
        vals = [(r.memory["by_category"].get(cat) or 0) / GiB if r.ok and r.memory else 0.0 for r in results]
        ax.bar(range(len(results)), vals, bottom=bottoms, label=cat, color=CATEGORY_COLORS[cat])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, r in enumerate(results):
        if not r.ok or not r.memory:
            text = r.status.upper() if not r.ok else "not measured"
            ax.annotate(text, (i, 0), ha="center", va="bottom", fontsize=8, color="#c44e52")
        elif r.peak_is_reserved:  # beside live peaks: say which bar is the allocator's reserved memory
            ax.annotate("reserved", (i, bottoms[i]), ha="center", va="bottom", fontsize=7, color="#555555")
    ax.set_xticks(range(len(results)), [tick(r.label) for r in results], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("peak memory (GiB)")
    methods = sorted({r.memory.get("method", "").split(":")[0] for r in results if r.ok and r.memory})
    ax.set_title(f"Peak memory by category ({'; '.join(methods) or 'n/a'})\n{devices_text(results)}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


MAX_TICK = 26  # characters of a run's label on an axis; the results table has the whole of it
MAX_LEGEND = 12  # legend entries: a panel's figure stays readable after many runs


def tick(label: str) -> str:
    """A run's label short enough for an axis: a long one keeps its "#n" and its start."""
    return label if len(label) <= MAX_TICK else label[: MAX_TICK - 1].rstrip(" ,") + "…"


def _legend(ax) -> None:
    """A legend of the latest MAX_LEGEND lines, beside the axes once there are several (inside, it would cover them)."""
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
    ax.set_title(f"{title}\n{devices_text(results)}", fontsize=9)
    _legend(ax)  # none without a labelled line


def plot_losses(results: list[RunResult], ax=None, validation: bool = True) -> Figure:
    """Training loss per optimizer step (and validation loss where measured), one line per run."""
    fig, ax = new_axes(ax)
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
    fig, ax = new_axes(ax)
    for r in (r for r in results if r.step_times):
        ms = [t * 1e3 for t in r.step_times]
        (line,) = ax.plot(range(len(ms)), ms, "-", lw=1, label=r.label)
        ex = [i for i in r.excluded_steps if i < len(ms)]
        ax.plot(ex, [ms[i] for i in ex], "o", mfc="none", color=line.get_color(), ms=6)
    ax.set_yscale("log")
    hollow = "step (hollow: warm-up / compile or memory-ledger steps, left out of the median)"
    _label(ax, hollow, "step time (ms)", "Step times", results)
    return fig


def plot_grad_norms(results: list[RunResult], ax=None) -> Figure:
    """The global gradient norm of every step (logged before clipping), log scale, one line per run; a run's
    clipping threshold as a dashed line of its colour, a step whose norm was not finite (fp16 overflow) as an x."""
    fig, ax = new_axes(ax)
    for r in (r for r in results if r.grad_norms):
        finite = [(i, g) for i, g in enumerate(r.grad_norms) if math.isfinite(g) and g > 0]
        (line,) = ax.plot(*zip(*finite), lw=1.2, label=r.label) if finite else ax.plot([], [], label=r.label)
        bad = [i for i, g in enumerate(r.grad_norms) if not math.isfinite(g)]
        if bad:
            ax.plot(bad, [max((g for _, g in finite), default=1.0)] * len(bad), "x", color=line.get_color(), ms=7)
        if (r.config or {}).get("clip_norm"):
            ax.axhline(r.config["clip_norm"], ls="--", lw=0.9, color=line.get_color())
    ax.set_yscale("log")
    norm = "global gradient norm, before clipping"
    _label(ax, "optimizer step (dashed: clipping threshold)", norm, "Gradient norm", results)
    return fig


def plot_lrs(results: list[RunResult], ax=None) -> Figure:
    """The learning rate each optimizer step used, one line per run."""
    fig, ax = new_axes(ax)
    for r in results:
        if r.lrs:
            ax.plot(range(len(r.lrs)), r.lrs, lw=1.2, label=r.label)
    _label(ax, "optimizer step", "learning rate", "Learning-rate schedule", results)
    return fig


PLOTS = {
    "speed": plot_speed,
    "memory": plot_memory,
    "loss": plot_losses,
    "step_times": plot_step_times,
    "grad_norm": plot_grad_norms,
    "lr": plot_lrs,
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
    """{index: speed-up over naive fp32} of a climb's ok rows: the ladder's paired `speedup`, or for results without
    it (a plain list of runs, an older file) tokens/s over the first ok run's."""
    base = next((r for r in results if r.ok and r.tokens_per_s), None)
    out = {}
    for i, r in enumerate(results):
        if r.ok and (r.ladder or {}).get("speedup"):
            out[i] = r.ladder["speedup"]
        elif r.ok and base and r.tokens_per_s and not r.ladder:
            out[i] = r.tokens_per_s / base.tokens_per_s
    return out


def plot_ladder(results: list[RunResult], reference: list[RunResult] | None = None, target: float = 10.0) -> Figure:
    """The ladder climbed: speed-up over naive fp32 (left) and peak memory by category with the factor saved (right).
    `reference` (shipped results, matched by rung label) adds its own line; `target` the course's promise."""
    fig = new_figure((12, 4.4))
    ax_speed, ax_mem = fig.subplots(1, 2)
    _ladder_speed(ax_speed, results, reference, target)
    plot_memory(results, ax=ax_mem)
    base = next((r for r in results if r.ok and r.peak_gib), None)
    for i, r in enumerate(results):  # short labels: eleven bars side by side
        if r.ok and base and r.peak_ratio(base):
            ratio = f"{r.peak_ratio(base):.2f}x"
            ax_mem.annotate(ratio, (i, r.peak_gib), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    if base:
        ax_mem.set_title(ax_mem.get_title().replace("\n", f"; labels: peak over {base.label}'s\n", 1), fontsize=9)
    ax_mem.margins(y=0.15)
    return fig


def _ladder_speed(ax, results: list[RunResult], reference: list[RunResult] | None, target: float) -> None:
    """plot_ladder's left panel: kept rungs joined, one not kept a grey cross, a skipped or failed one its status."""
    mine = ladder_speedups(results)
    kept = {i: v for i, v in mine.items() if (results[i].ladder or {}).get("kept", True)}
    dropped = {i: v for i, v in mine.items() if i not in kept}
    if kept:
        ax.plot(*zip(*kept.items()), "o-", color="#4c72b0", label=f"this machine, kept: {devices_text(results)}")
    if dropped:
        ax.plot(*zip(*dropped.items()), "x", color="#999999", ms=8, mew=2, label="measured, not kept")
    for i, v in mine.items():
        color = "#4c72b0" if i in kept else "#777777"
        ax.annotate(f"{v:.2f}x", (i, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8, c=color)
    for i, r in enumerate(results):
        if not r.ok:
            ax.annotate(r.status.upper(), (i, 1.0), ha="center", va="bottom", fontsize=8, color="#c44e52", rotation=90)
    labels = [r.label for r in results]
    ref = {reference[i].label: v for i, v in ladder_speedups(reference).items()} if reference else {}
    points = [(i, ref[lab]) for i, lab in enumerate(labels) if lab in ref]
    if points:
        ax.plot(*zip(*points), "s--", color="#dd8452", label=f"reference: {devices_text(reference)}")
    if target:
        ax.axhline(target, ls=":", color="#888888", label=f"the course's promise (~{target:g}x)")
    ax.axhline(1.0, lw=0.8, color="#cccccc")
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), [tick(lab) for lab in labels], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed-up over naive fp32 (x, log scale)")
    ax.set_title("Speed, rung by rung", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
