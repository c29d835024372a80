"""Notebook 02's own figures: a predicted peak beside a device's memory, and the ledger's live memory over a step."""

from __future__ import annotations

from matplotlib.figure import Figure

from ..plots import CATEGORY_COLORS, new_figure


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


PHASE_COLORS = {"forward": "#4c72b0", "loss": "#8172b3", "backward": "#c44e52", "optimizer": "#55a868"}  # else grey


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
            ax.plot(*zip(*points), ".", ms=2, color=PHASE_COLORS.get(phase, "#a0a0a0"), label=phase)
        ax.axhline(rep.peak_bytes / 2**20, color="k", lw=0.6, ls=":")
        ax.set_title(f"{name}: peak {rep.peak_bytes / 2**20:.2f} MiB", fontsize=9)
        ax.set_xlabel("operation number")
    axes[0].set_ylabel("live tensor memory (MiB)")
    axes[-1].legend(fontsize=7, markerscale=4)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig
